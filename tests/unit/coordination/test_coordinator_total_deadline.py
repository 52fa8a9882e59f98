"""A checkpoint's overall deadline (`total_s`): fit inside it, or fail whole.

Signal and drain checkpoints give the coordinator a budget for the whole
checkpoint.  The phase deadlines are cut to fit it, and a checkpoint whose
participants committed but which is not ready to publish inside it is not
published: no Gym manifest (so no `LATEST`), everyone resumed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from ray_ckpt.errors import CoordinationFailed, InvalidRequest
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import Fleet, make_fleet


class JumpClock:
    """Real time plus jumps the test makes (the core's clock only)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> float:
        return time.time() + self.offset


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = make_fleet()
    f.parts["environment/env"].start("r1", at_boundary=True, state={"step": 3})
    yield f
    await f.aclose()


def jump_after_commit(fleet: Fleet, clock: JumpClock, key: str, seconds: float) -> None:
    """`key`'s commit succeeds, and then `seconds` pass on the core's clock."""
    host = fleet.hosts[key]
    call = host.call

    async def late(op: str, body: Any) -> dict[str, Any]:
        reply = await call(op, body)
        if op == "commit":
            clock.offset += seconds
        return reply

    host.call = late  # type: ignore[method-assign]


async def test_a_checkpoint_not_ready_to_publish_in_time_fails_whole(fleet: Fleet) -> None:
    clock = JumpClock()
    fleet.core.clock = clock
    jump_after_commit(fleet, clock, "resources/res", 10.0)
    with pytest.raises(CoordinationFailed) as info:
        await fleet.core.checkpoint("/ck", [EpisodeId("r1")], total_s=5.0)
    assert info.value.failures["gym-manifest"]["code"] == "deadline_exceeded"
    assert sorted(fleet.events("commit", "reply")) == sorted(fleet.hosts)  # all committed
    assert fleet.manifests == []  # never published
    assert fleet.core.open is None
    assert set(fleet.phases().values()) == {"idle"}  # everyone resumed


async def test_the_same_late_checkpoint_without_a_budget_is_published(fleet: Fleet) -> None:
    clock = JumpClock()
    fleet.core.clock = clock
    jump_after_commit(fleet, clock, "resources/res", 10.0)
    result = await fleet.core.checkpoint("/ck", [EpisodeId("r1")])
    assert [cid for _, cid, _ in fleet.manifests] == [result.checkpoint_id]


async def test_phase_deadlines_are_cut_to_fit_the_budget(fleet: Fleet) -> None:
    start = time.time()
    await fleet.core.checkpoint(
        "/ck", [EpisodeId("r1")], prepare_s=60.0, commit_s=60.0, total_s=1.5
    )
    host = fleet.hosts["environment/env"]
    bodies = {op: body for op, body in host.calls if op in ("prepare", "commit")}
    assert bodies["prepare"]["deadline_ts"] <= start + 1.5 + 0.05
    assert bodies["commit"]["deadline_ts"] <= start + 1.5 + 0.05
    assert len(fleet.manifests) == 1


@pytest.mark.parametrize("total_s", [0.0, -1.0])
async def test_a_budget_that_is_not_positive_is_refused_before_anything(
    fleet: Fleet, total_s: float
) -> None:
    with pytest.raises(InvalidRequest):
        await fleet.core.checkpoint("/ck", [EpisodeId("r1")], total_s=total_s)
    assert fleet.log == []  # no participant was called
    assert fleet.core.open is None
