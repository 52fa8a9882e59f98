"""Checked registration: a participant is who its status says it is.

A participant registered (or discovered) as `<kind>/<name>` must report that
kind in `status.kind`: a policy model registered as an environment would be
prepared in the wrong stage and its records written under the wrong kind.
The check asks the participant's status once at registration.  A participant
that cannot be reached yet is registered unchecked (it may still be
starting; every later call names it if it stays away); one that answers 404
on status is not a participant at all (NeMo Gym's discovery skips such
servers: an auxiliary judge model, a legacy relay).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from coordination.engine.calls import coordination_failed
from coordination.engine.fanout import failure
from coordination.engine.host import Host
from coordination.engine.replies import as_mapping
from ray_ckpt.control.client import ControlClient
from ray_ckpt.errors import CheckpointError, InvalidRequest, NotFound, ParticipantUnavailable
from ray_ckpt.workers.detect import refuse_unmanaged_workers

log = logging.getLogger(__name__)


class KindMismatch(InvalidRequest):
    """The participant reports another kind than it was registered as."""


def check_kind(host: Host, status: Any) -> None:
    """Raise `KindMismatch` if `status.kind` is not the registered kind.

    A status without a `kind` string is not refused: nothing to contradict."""
    kind = as_mapping(status).get("kind")
    m = host.member
    if isinstance(kind, str) and kind != m.kind:
        raise KindMismatch(
            f"{m.key} reports kind {kind!r} in its status, not {m.kind!r}: "
            f"register it as {kind}/{m.name}"
        )


async def probe(host: Host, timeout_s: float) -> dict[str, Any] | None:
    """The host's status, or None if it cannot be reached now.

    Raises `NotFound` (404: not a participant), `KindMismatch`, or the typed
    error of any other refusal."""
    try:
        status = await asyncio.wait_for(host.status(), timeout_s)
    except (TimeoutError, ParticipantUnavailable) as exc:
        log.warning(
            "%s: status unreachable at registration (%s); kind unchecked", host.member.key, exc
        )
        return None
    check_kind(host, status)
    client = getattr(host, "client", None)
    if isinstance(client, ControlClient):
        # Reached over HTTP: several processes each with its own controller
        # behind one port cannot be paused as one.
        await refuse_unmanaged_workers(client, dict(as_mapping(status)), what=host.member.key)
    return dict(as_mapping(status))


async def checked(host: Host, timeout_s: float) -> dict[str, Any] | None:
    """`host`'s status, once it confirms its kind (see `probe`; None: not
    reachable now); a 404 is refused as "not a participant", typed."""
    try:
        return await probe(host, timeout_s)
    except NotFound as exc:
        raise InvalidRequest(f"{host.member.key} is not a participant: {exc.detail}") from None


async def discover_candidates(
    candidates: Sequence[Host],
    timeout_s: float,
    statuses: dict[str, dict[str, Any]] | None = None,
) -> tuple[list[Host], list[Host]]:
    """(participants, not participants) among `candidates`, probed at once.

    As NeMo Gym's discovery: a 404 on status means "not a participant"
    (skipped); any other failure, or a kind mismatch, fails the discovery
    naming each candidate (`CoordinationFailed`), and nobody is taken."""
    results = await asyncio.gather(
        *(probe(h, timeout_s) for h in candidates), return_exceptions=True
    )
    found: list[Host] = []
    skipped: list[Host] = []
    failures: dict[str, dict[str, Any]] = {}
    for host, res in zip(candidates, results, strict=True):
        key = host.member.key
        if isinstance(res, NotFound):
            skipped.append(host)
        elif isinstance(res, CheckpointError):
            failures[key] = failure(res)
        elif isinstance(res, BaseException):
            failures[key] = failure(ParticipantUnavailable(f"status of {key}: {res!r}"[:500]))
        elif res is None:
            failures[key] = failure(ParticipantUnavailable(f"status of {key}: no reply"))
        else:
            found.append(host)
            if statuses is not None:
                statuses[key] = res
    if failures:
        raise coordination_failed("discover", "discovery", failures)
    return found, skipped
