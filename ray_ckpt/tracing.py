"""OpenTelemetry spans, when `opentelemetry-api` is importable.

NeMo Gym traces its servers with OpenTelemetry; with these spans a
checkpoint shows up inside those traces: the coordinator opens one span per
checkpoint and one per phase call per participant, the HTTP control client
carries the context on the request (`traceparent`, W3C Trace Context), and
the participant's control routes open their span as its child.  Nothing is
configured here: without the API, or with the API but no SDK/exporter set up
by the application, every span is a no-op costing a function call.  (The
Ray actor transport carries no context: its bodies are typed and closed.)

`recorded` is the one span system of the coordinator's phases: the block is
an OpenTelemetry span, and the same span, with the same start and end, is
handed as a `SpanRecord` to a sink — the checkpoint's timeline, which is
saved with the checkpoint — while the call timings the metrics observe are
the records' durations.  So a trace, a timeline and a histogram of one
checkpoint can never disagree about when a phase ran.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec

try:
    from opentelemetry import propagate, trace
except ImportError:  # pragma: no cover - the API is optional
    trace = None  # type: ignore[assignment]
    propagate = None  # type: ignore[assignment]

NAME = "ray_ckpt"


class SpanRecord(msgspec.Struct, frozen=True):
    """One finished span as data (times in epoch seconds)."""

    row: str  # "coordinator" or a participant key `<kind>/<name>`
    name: str  # prepare, commit, capture, write, publish, ...
    start: float
    end: float
    ok: bool = True

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def shifted(self, by: float) -> SpanRecord:
        """The same span on a clock `by` seconds ahead (the coordinator's)."""
        return SpanRecord(self.row, self.name, self.start + by, self.end + by, self.ok)


SpanSink = Callable[[SpanRecord], None]


class Recording:
    """What `recorded` yields: the block marks a failure with `failed()`
    (an exception leaving the block marks it too)."""

    __slots__ = ("ok", "record")

    def __init__(self) -> None:
        self.ok = True
        self.record: SpanRecord | None = None  # set when the block ends

    def failed(self) -> None:
        self.ok = False


@contextlib.contextmanager
def recorded(
    name: str,
    row: str,
    sink: SpanSink | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[Recording]:
    """The span `ray_ckpt.<name>` around the block, current inside it, and
    the same span as a `SpanRecord` (row `row`) given to `sink` when it ends.
    The record's end is its start plus the monotonic time the block took, so
    a wall-clock step never makes a negative duration; OpenTelemetry is given
    exactly the record's start and end."""
    rec = Recording()
    start, mono = time.time(), time.monotonic()
    otel = None
    if trace is not None:
        attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
        otel = trace.get_tracer(NAME).start_span(
            f"{NAME}.{name}", attributes=attrs, start_time=int(start * 1e9)
        )
    try:
        if otel is not None:
            with trace.use_span(otel, end_on_exit=False):
                yield rec
        else:
            yield rec
    except BaseException:
        rec.ok = False
        raise
    finally:
        end = start + (time.monotonic() - mono)
        rec.record = SpanRecord(row, name, start, end, rec.ok)
        if otel is not None:
            otel.end(end_time=int(end * 1e9))
        if sink is not None:
            sink(rec.record)


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
