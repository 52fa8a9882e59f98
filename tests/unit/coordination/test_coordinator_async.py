"""The coordinator's asynchronous checkpoint over in-process participants:
returned once the Gym resumed, durable later, the Gym manifest last; a failed
write fails it with the participant's error and publishes nothing."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from coordination.reach.hosts import FakePauseTarget
from ray_ckpt.errors import CoordinationFailed, InvalidCheckpointState, InvalidRequest
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import make_fleet


async def test_returned_resumed_then_durable_with_the_gym_manifest_last() -> None:
    fleet = make_fleet()
    trainer = FakePauseTarget("trainer")
    fleet.core.register_pause(trainer)
    fleet.store.write_gate = threading.Event()  # every write waits: a slow disk
    try:
        fleet.parts["environment/env"].start("r1", at_boundary=True, state={"x": 1})
        result = await fleet.core.checkpoint("/ck", [EpisodeId("r1")], durability="async")
        assert result.pending is True
        assert result.durability == "async"
        assert result.continued == ["r1"]
        # The Gym and the trainer run again; nothing is published yet.
        assert set(fleet.phases().values()) == {"idle"}
        assert trainer.paused is None
        assert fleet.manifests == []
        fleet.store.write_gate.set()
        done = await fleet.core.durable(result.checkpoint_id)
        assert done.checkpoint_id == result.checkpoint_id
        assert [(d, cid) for d, cid, _ in fleet.manifests] == [("/ck", result.checkpoint_id)]
        listed = {(m["kind"], m["instance"]) for m in fleet.manifests[0][2]}
        assert listed == {tuple(k.split("/")) for k in fleet.parts}
        assert (await fleet.core.durable(result.checkpoint_id)) == done  # asked again
    finally:
        await fleet.aclose()


async def test_a_failed_write_fails_the_pending_checkpoint_and_publishes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fleet = make_fleet()
    real_write = fleet.store.write

    def write(checkpoint_dir: str, **kw: Any) -> Any:
        if kw["kind"] == "agent":
            raise InvalidCheckpointState("records write failed: ENOSPC (test)")
        return real_write(checkpoint_dir, **kw)

    monkeypatch.setattr(fleet.store, "write", write)
    try:
        result = await fleet.core.checkpoint("/ck", None, durability="async")
        with pytest.raises(CoordinationFailed) as info:
            await fleet.core.durable(result.checkpoint_id)
        assert set(info.value.failures) == {"agent/agent"}
        assert "ENOSPC" in info.value.failures["agent/agent"]["detail"]
        assert fleet.manifests == []
        # The next checkpoint is not held up by it, and publishes.
        monkeypatch.undo()
        again = await fleet.core.checkpoint("/ck2", None)
        assert [cid for _, cid, _ in fleet.manifests] == [again.checkpoint_id]
    finally:
        await fleet.aclose()


async def test_the_next_checkpoint_publishes_after_the_pending_one() -> None:
    fleet = make_fleet()
    writer = fleet.core.manifest_writer

    def slow_for_the_first(d: str, cid: str, ms: list[dict[str, Any]]) -> None:
        if d == "/a":
            time.sleep(0.3)  # its publish is slow; the next one must not overtake it
        writer(d, cid, ms)

    fleet.core.manifest_writer = slow_for_the_first
    try:
        first = await fleet.core.checkpoint("/a", None, durability="async")
        second = await fleet.core.checkpoint("/b", None)
        # LATEST never goes back: the pending one's Gym manifest came first.
        assert [cid for _, cid, _ in fleet.manifests] == [first.checkpoint_id, second.checkpoint_id]
    finally:
        await fleet.aclose()


async def test_bad_asynchronous_requests_are_refused_before_anyone_is_paused() -> None:
    fleet = make_fleet()
    try:
        for kwargs in ({"stop": True}, {"resume": False}, {"total_s": 5.0}):
            with pytest.raises(InvalidRequest):
                await fleet.core.checkpoint("/ck", None, durability="async", **kwargs)
        with pytest.raises(InvalidRequest):
            await fleet.core.checkpoint("/ck", None, durability="eventually")
        with pytest.raises(InvalidRequest, match="no asynchronous checkpoint"):
            await fleet.core.durable("ckpt-unknown")
        assert fleet.events("prepare") == []
        assert set(fleet.phases().values()) == {"idle"}
    finally:
        await fleet.aclose()


async def test_an_aborted_asynchronous_checkpoint_writes_nothing_anywhere() -> None:
    """A commit that fails at one member after the others captured their
    records aborts the checkpoint: their resume says so, and they discard the
    capture instead of writing records nothing will ever publish (and that a
    retry into the same directory would find in its way)."""
    fleet = make_fleet()
    fleet.hosts["agent/agent"].fail["commit"] = InvalidCheckpointState("disk gone (test)")
    try:
        fleet.parts["environment/env"].start("r1", at_boundary=True, state={"x": 1})
        with pytest.raises(CoordinationFailed, match="agent/agent"):
            await fleet.core.checkpoint("/ck", [EpisodeId("r1")], durability="async")
        assert set(fleet.phases().values()) == {"idle"}
        resumes = [b for h in fleet.hosts.values() for op, b in h.calls if op == "resume"]
        assert resumes and all(b.get("abort") is True for b in resumes)
        for ctrl in fleet.ctrls.values():
            await ctrl._background.wait_idle(5.0)
            assert ctrl.writes_in_flight == 0
        assert fleet.store.writes == 0
        assert fleet.store.data == {}
        # A sync checkpoint's abort sends no such field: older participants refuse it.
        fleet.hosts["agent/agent"].fail.clear()
        fleet.hosts["model/policy"].fail["commit"] = InvalidCheckpointState("test")
        for host in fleet.hosts.values():
            host.calls.clear()
        with pytest.raises(CoordinationFailed):
            await fleet.core.checkpoint("/ck2", [EpisodeId("r1")])
        resumes = [b for h in fleet.hosts.values() for op, b in h.calls if op == "resume"]
        assert resumes and not any("abort" in b for b in resumes)
    finally:
        await fleet.aclose()
