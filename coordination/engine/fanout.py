"""Calls to one group go out together and are awaited together under a deadline.

No `ray.get`/`ray.wait`: each call is a task awaiting its object ref, so the
coordinator's event loop stays free; stragglers are cancelled (which cancels
the remote work, see `coordination.reach.hosts`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordination.engine.host import Host
from coordination.engine.replies import (
    blocker_count,
    blocker_details,
    blocker_keys,
)
from ray_ckpt import tracing
from ray_ckpt.errors import CheckpointError, DeadlineExceeded, ParticipantUnavailable
from ray_ckpt.tracing import SpanRecord, SpanSink


@dataclass
class Outcome:
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, CheckpointError] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # Each call's span (epoch seconds, `time.time`): `timings` are their
    # durations, and the coordinator's timeline keeps them as they are.
    spans: dict[str, SpanRecord] = field(default_factory=dict)

    def merge(self, other: Outcome) -> None:
        self.replies.update(other.replies)
        self.errors.update(other.errors)
        self.timings.update(other.timings)
        self.spans.update(other.spans)


async def _timed(host: Host, op: str, body: Mapping[str, Any], sink: SpanSink) -> dict[str, Any]:
    """One call inside its span (`tracing.recorded`): the record the sink gets
    is the trace's span, the timeline's slice and the metrics' timing."""
    attrs = {
        "ray_ckpt.participant": host.member.key,
        "ray_ckpt.checkpoint_id": body.get("checkpoint_id"),
    }
    with tracing.recorded(op, host.member.key, sink, attrs):
        reply: dict[str, Any] = await host.call(op, body)
    return reply


async def fan_out(
    group: Sequence[Host],
    op: str,
    body: Callable[[Host], Mapping[str, Any]],
    timeout_s: float,
) -> Outcome:
    """Call `op` on every host of `group` at once; wait at most `timeout_s`."""
    out = Outcome()
    if not group:
        return out
    start = time.monotonic()
    spans: dict[str, SpanRecord] = {}

    def keep(record: SpanRecord) -> None:
        spans[record.row] = record

    tasks = {asyncio.ensure_future(_timed(h, op, body(h), keep)): h for h in group}
    try:
        _, pending = await asyncio.wait(tasks, timeout=max(timeout_s, 0.0))
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        raise
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending)
    for task, host in tasks.items():
        key = host.member.key
        if task in pending:
            out.errors[key] = DeadlineExceeded(
                f"{key} did not answer {op} within {timeout_s:.3f}s; call cancelled"
            )
            out.timings[key] = time.monotonic() - start
            continue
        exc = task.exception()
        if exc is None:
            reply = task.result()
            if isinstance(reply, Mapping):
                out.replies[key] = dict(reply)
            else:
                # Read tolerantly everywhere else; a reply that is not even an
                # object fails only that participant, named.
                out.errors[key] = ParticipantUnavailable(
                    f"{op} to {key}: reply is not a JSON object: {reply!r}"[:500]
                )
        elif isinstance(exc, CheckpointError):
            out.errors[key] = exc
            out.timings[key] = time.monotonic() - start
        else:
            out.errors[key] = ParticipantUnavailable(f"{op} to {key} failed: {exc!r}"[:500])
            out.timings[key] = time.monotonic() - start
    for key, record in spans.items():
        # A failed call's span says so, whatever the reply looked like.
        failed = key in out.errors
        out.spans[key] = SpanRecord(
            record.row, record.name, record.start, record.end, record.ok and not failed
        )
        out.timings[key] = record.seconds
    return out


def failure(err: CheckpointError, report: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A participant's failure as data: code, detail, and its blockers if known."""
    entry: dict[str, Any] = {"code": err.code, "detail": err.detail}
    if report:
        entry["blockers"] = blocker_keys(report)
        entry["blocker_count"] = blocker_count(report)
        details = blocker_details(report)
        if any(set(d) - {"key"} for d in details):
            entry["blocker_details"] = details
    return entry
