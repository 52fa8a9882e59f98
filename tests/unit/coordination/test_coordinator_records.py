"""Whichever entry points drive a checkpoint — `checkpoint()` whole, or the
split `prepare()` / `commit()` / `resume()` of the README's training loop —
it leaves the same records: the same metrics with the same labels, the same
timeline rows and outcome, `status.last_checkpoint`, one tracing span; and a
checkpoint called off, or failed, is recorded as such."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from coordination.engine.coordinator_core import CoordinatorCore
from coordination.engine.metrics import CoordinatorMetrics
from coordination.engine.timeline import Timeline
from ray_ckpt.errors import CoordinationFailed, InvalidCheckpointState
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import Fleet, make_fleet
from tests.unit.coordination.test_coordinator_metrics import RecordingSink

SCOPE = [EpisodeId("r1"), EpisodeId("r2")]
Drive = Callable[[CoordinatorCore], Coroutine[Any, Any, str]]


async def whole(core: CoordinatorCore) -> str:
    return (await core.checkpoint("/ck", SCOPE)).checkpoint_id


async def split(core: CoordinatorCore) -> str:
    prepared = await core.prepare()
    await core.commit("/ck", SCOPE)
    await core.resume()
    return prepared.checkpoint_id


async def kept_open(core: CoordinatorCore) -> str:
    result = await core.checkpoint("/ck", SCOPE, resume=False)
    await core.resume()  # the trainer published its own checkpoint meanwhile
    return result.checkpoint_id


def shape(fleet: Fleet, sink: RecordingSink, cid: str) -> dict[str, Any]:
    tl: Timeline = fleet.core.timeline.get(cid)
    last = fleet.core.last_checkpoint
    return {
        "metrics": sorted({(n, tuple(sorted(t.items()))) for n, _, t in sink.seen}),
        "counts": sorted(n for n, _, _ in sink.seen),
        "timeline": (tl.op, tl.trigger, tl.outcome, sorted({(s.row, s.name) for s in tl.spans})),
        "last": None if last is None else (last.checkpoint_id == cid, last.trigger),
    }


async def records_of(drive: Drive) -> dict[str, Any]:
    fleet = make_fleet()
    sink = RecordingSink()
    fleet.core.metrics = CoordinatorMetrics(sink)
    try:
        fleet.parts["environment/env"].start("r1", at_boundary=True, state={"x": 1})
        cid = await drive(fleet.core)
        assert set(fleet.phases().values()) == {"idle"} and fleet.core.open is None
        return shape(fleet, sink, cid)
    finally:
        await fleet.aclose()


async def test_the_split_calls_and_checkpoint_leave_the_same_records() -> None:
    expected = await records_of(whole)
    assert expected["last"] == (True, "manual")
    assert expected["timeline"][2] == "ok"
    assert await records_of(split) == expected
    assert await records_of(kept_open) == expected


async def test_a_split_checkpoint_called_off_is_recorded_aborted() -> None:
    fleet = make_fleet()
    sink = RecordingSink()
    fleet.core.metrics = CoordinatorMetrics(sink)
    try:
        prepared = await fleet.core.prepare()
        await fleet.core.resume()
        assert sink.values("checkpoints_total") == [
            (1, {"trigger": "manual", "outcome": "aborted"})
        ]
        assert fleet.core.timeline.get(prepared.checkpoint_id).outcome == "aborted"
        assert fleet.core.last_checkpoint is None
    finally:
        await fleet.aclose()


@pytest.mark.parametrize("drive", [whole, split], ids=["whole", "split"])
async def test_a_failed_commit_is_recorded_failed_once(drive: Drive) -> None:
    fleet = make_fleet()
    sink = RecordingSink()
    fleet.core.metrics = CoordinatorMetrics(sink)
    fleet.hosts["agent/agent"].fail["commit"] = InvalidCheckpointState("disk gone (test)")
    try:
        with pytest.raises(CoordinationFailed):
            await drive(fleet.core)
        assert sink.values("checkpoints_total") == [
            (1, {"trigger": "manual", "outcome": "failed"})
        ]
        assert [t for _, t in sink.values("failures_total")] == [
            {"phase": "commit", "code": "invalid_checkpoint_state"}
        ]
        assert fleet.core.timeline.get("latest").outcome == "failed"
        assert fleet.core.open is None and set(fleet.phases().values()) == {"idle"}
    finally:
        await fleet.aclose()
