"""Status rows: each participant's reply to a status call, as a `ParticipantStatus`.

`participant_rows` asks every host at once and waits at most `timeout_s`; a
host that does not answer in time, or fails, still gets a row saying so, so
one stuck participant never hides the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from coordination.engine.host import Host
from coordination.engine.replies import (
    as_mapping,
    blocker_count,
    blocker_details,
    blocker_keys,
    float_or_none,
    int_or_none,
    report_of,
    str_or_none,
)
from coordination.engine.results import ParticipantStatus


async def participant_rows(hosts: Iterable[Host], timeout_s: float) -> list[ParticipantStatus]:
    """One row per host, in member order."""
    ordered = sorted(hosts, key=lambda h: h.member)
    tasks = [asyncio.ensure_future(h.status()) for h in ordered]
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)
    return [status_row(h, t) for h, t in zip(ordered, tasks, strict=True)]


def status_row(host: Host, task: asyncio.Future[dict[str, Any]]) -> ParticipantStatus:
    m = host.member
    transport = host.describe().get("transport", "?")
    if task.cancelled():
        return ParticipantStatus(
            participant=m.key, kind=m.kind, transport=transport, error="no reply"
        )
    exc = task.exception()
    if exc is not None:
        return ParticipantStatus(
            participant=m.key, kind=m.kind, transport=transport, error=str(exc)[:200]
        )
    s = as_mapping(task.result())
    report = report_of(s)
    return ParticipantStatus(
        participant=m.key,
        kind=m.kind,
        transport=transport,
        phase=str_or_none(s.get("phase")),
        checkpoint_id=str_or_none(s.get("checkpoint_id")),
        lease_expires_at=float_or_none(s.get("lease_expires_at")),
        live_executions=int_or_none(s.get("live_executions")),
        retired_rollouts=int_or_none(s.get("retired_rollouts")),
        blockers=blocker_keys(report),
        blocker_count=blocker_count(report),
        blocker_details=blocker_details(report),
        writes_in_flight=int_or_none(s.get("writes_in_flight")),
        unacknowledged_results=int_or_none(s.get("unacknowledged_results")),
        unacknowledged_bytes=int_or_none(s.get("unacknowledged_bytes")),
        live_keys=_keys(s.get("live_keys")),
        needs_scope=s.get("needs_scope") is True,
    )


def _keys(value: Any) -> list[str] | None:
    return [str(k) for k in value] if isinstance(value, list) else None
