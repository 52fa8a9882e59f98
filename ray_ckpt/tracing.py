"""OpenTelemetry spans, when `opentelemetry-api` is importable.

NeMo Gym traces its servers with OpenTelemetry; with these spans a
checkpoint shows up inside those traces: the coordinator opens one span per
checkpoint and one per phase call per participant, the HTTP control client
carries the context on the request (`traceparent`, W3C Trace Context), and
the participant's control routes open their span as its child.  Nothing is
configured here: without the API, or with the API but no SDK/exporter set up
by the application, every span is a no-op costing a function call.  (The
Ray actor transport carries no context: its bodies are typed and closed.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

try:
    from opentelemetry import propagate, trace
except ImportError:  # pragma: no cover - the API is optional
    trace = None  # type: ignore[assignment]
    propagate = None  # type: ignore[assignment]

NAME = "ray_ckpt"


@contextlib.contextmanager
def span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    carrier: Mapping[str, str] | None = None,
) -> Iterator[None]:
    """A span named `name`, current inside the block; a child of the context
    `carrier` holds (request headers) when given, else of the current span."""
    if trace is None:
        yield
        return
    ctx = propagate.extract(dict(carrier)) if carrier else None
    attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
    with trace.get_tracer(NAME).start_as_current_span(name, context=ctx, attributes=attrs):
        yield


def start(name: str, attributes: Mapping[str, Any] | None = None) -> Any:
    """A span that outlives one block (a checkpoint opened by one call and
    closed by another): started now, a child of the current span; `within`
    makes it current for a block, `end` ends it.  None without the API."""
    if trace is None:
        return None
    attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
    return trace.get_tracer(NAME).start_span(name, attributes=attrs)


@contextlib.contextmanager
def within(started: Any) -> Iterator[None]:
    """`started` (from `start`) current inside the block, not ended by it."""
    if trace is None or started is None:
        yield
        return
    with trace.use_span(started, end_on_exit=False):
        yield


def end(started: Any, attributes: Mapping[str, Any] | None = None) -> None:
    if trace is None or started is None:
        return
    for key, value in (attributes or {}).items():
        if value is not None:
            started.set_attribute(key, value)
    started.end()


def inject(headers: dict[str, str]) -> None:
    """Put the current span's context into outgoing request headers."""
    if propagate is not None:
        propagate.inject(headers)


TRACE_HEADERS = ("traceparent", "tracestate")
