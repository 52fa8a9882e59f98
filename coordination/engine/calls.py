"""What every coordinated call shares: IDs, episode bodies, reply timeouts, failures.

The phase driver, the restore and the retire/forget paths all build request
bodies and raise `CoordinationFailed` the same way; those few helpers live
here so none of those modules has to import another's internals.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from coordination.engine.results import Timeouts
from ray_ckpt.clock import Clock
from ray_ckpt.errors import CoordinationFailed
from ray_ckpt.identity import EpisodeId


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def reply_timeout(clock: Clock, timeouts: Timeouts, deadline_ts: float) -> float:
    """How long to wait for replies to a call with this deadline (plus the grace)."""
    return max(deadline_ts - clock.now(), 0.0) + timeouts.reply_grace_s


def episode_body(e: EpisodeId | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(e, EpisodeId):
        return {"rollout_id": e.rollout_id, "attempt": e.attempt}
    return dict(e)


def coordination_failed(
    op: str, cid: str, failures: dict[str, dict[str, Any]]
) -> CoordinationFailed:
    names = ", ".join(
        f"{k} ({v['code']}" + (f"; blockers {v['blockers']}" if v.get("blockers") else "") + ")"
        for k, v in sorted(failures.items())
    )
    return CoordinationFailed(f"{op} of {cid} failed at {names}", operation=op, failures=failures)
