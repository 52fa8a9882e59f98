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


@dataclass
class Outcome:
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, CheckpointError] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # When each answered call ran (time.monotonic), for the timeline.
    windows: dict[str, tuple[float, float]] = field(default_factory=dict)

    def merge(self, other: Outcome) -> None:
        self.replies.update(other.replies)
        self.errors.update(other.errors)
        self.timings.update(other.timings)
        self.windows.update(other.windows)


async def _timed(
    host: Host, op: str, body: Mapping[str, Any]
) -> tuple[dict[str, Any], float, float]:
    start = time.monotonic()
    attrs = {
        "ray_ckpt.participant": host.member.key,
        "ray_ckpt.checkpoint_id": body.get("checkpoint_id"),
    }
    with tracing.span(f"ray_ckpt.{op}", attrs):
        reply = await host.call(op, body)
    return reply, start, time.monotonic()


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
    tasks = {asyncio.ensure_future(_timed(h, op, body(h))): h for h in group}
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
            reply, began, ended = task.result()
            out.timings[key] = ended - began
            out.windows[key] = (began, ended)
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
