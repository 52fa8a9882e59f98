"""Commit on the participant: the reply is cached only once the whole commit
finished, so a release step that times out (or a cancelled call) is retried
with the same ID instead of answering `invalid_phase` for ever."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from ray_ckpt import EpisodeId, ManualClock, Record
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import DeadlineExceeded, InvalidCheckpointState, StaleCheckpoint
from ray_ckpt.settings import CheckpointSettings
from tests.unit.fakes import FakeParticipant, Manifest, MemoryStore
from tests.unit.helpers import T0, body_t0


class SlowRelease(FakeParticipant):
    """`delete_restored` and `park_exported` wait for their gates."""

    def __init__(self) -> None:
        super().__init__()
        self.release_gate: asyncio.Event | None = None
        self.park_gate: asyncio.Event | None = None
        self.release_calls = 0
        self.parked: list[list[str]] = []

    async def delete_restored(self, keep: Sequence[EpisodeId]) -> list[str]:
        self.release_calls += 1
        if self.release_gate is not None:
            await self.release_gate.wait()
        return await super().delete_restored(keep)

    async def park_exported(self, records: list[Record]) -> None:
        if self.park_gate is not None:
            await self.park_gate.wait()
        self.parked.append([r.key for r in records])


SCOPE = [{"rollout_id": "a", "attempt": 1}]


async def restored_then_prepared() -> tuple[ParticipantEngine, SlowRelease, MemoryStore]:
    """A participant holding restored a-a1 and b-a2, prepared for c1."""
    p = SlowRelease()
    store = MemoryStore()
    store.data[("/old", "environment", "env0")] = (
        Manifest("c0", "environment", "env0", 2),
        [Record("a", 1), Record("b-a1", 2)],
    )
    settings = CheckpointSettings(enabled=True, control_auth_token="t")
    c = ParticipantEngine(
        p, instance="env0", settings=settings, clock=ManualClock(T0), store=store
    )
    await c.handle(
        "restore",
        body_t0(
            "c0",
            checkpoint_dir="/old",
            episode_ids=[{"rollout_id": "a"}, {"rollout_id": "b", "attempt": 1}],
        ),
    )
    await c.handle("resume", body_t0("c0"))
    await c.handle("prepare", body_t0("c1"))
    return c, p, store


async def test_a_release_step_that_times_out_is_retried_with_the_same_id() -> None:
    c, p, store = await restored_then_prepared()
    p.release_gate = asyncio.Event()
    with pytest.raises(DeadlineExceeded, match="release unscoped"):
        await c.handle("commit", body_t0("c1", 0.05, checkpoint_dir="/new", episode_ids=SCOPE))
    assert c.status()["phase"] == "committed"  # the records are durable
    assert p.restored == {"a-a1": 1, "b-a2": 2}  # the release did not happen
    p.release_gate = None
    reply = await c.handle("commit", body_t0("c1", checkpoint_dir="/new", episode_ids=SCOPE))
    assert reply["phase"] == "committed"
    assert reply["episode_ids"] == ["a-a1"]
    assert p.restored == {"a-a1": 1}
    assert p.deleted == ["b-a2"]
    assert store.writes == 1  # the retry did not write again
    # Now it finished: a replay answers the cached reply without releasing again.
    calls = p.release_calls
    assert (
        await c.handle("commit", body_t0("c1", checkpoint_dir="/new", episode_ids=SCOPE)) == reply
    )
    assert p.release_calls == calls


async def test_a_commit_call_cancelled_in_its_release_step_is_retried() -> None:
    c, p, store = await restored_then_prepared()
    p.release_gate = asyncio.Event()
    call = asyncio.create_task(
        c.handle("commit", body_t0("c1", checkpoint_dir="/new", episode_ids=SCOPE))
    )
    await asyncio.sleep(0.05)
    assert p.release_calls == 1
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    p.release_gate.set()
    reply = await c.handle("commit", body_t0("c1", checkpoint_dir="/new", episode_ids=SCOPE))
    assert reply["episode_ids"] == ["a-a1"]
    assert p.restored == {"a-a1": 1}
    assert store.writes == 1


async def test_a_park_that_times_out_is_parked_by_the_retry_once() -> None:
    c, p, store = await restored_then_prepared()
    p.park_gate = asyncio.Event()
    stop = body_t0("c1", deadline=0.05, checkpoint_dir="/new", episode_ids=SCOPE, stop=True)
    with pytest.raises(DeadlineExceeded, match="park exported"):
        # (wait_for: a park without a deadline would hang this test instead.)
        await asyncio.wait_for(c.handle("commit", stop), 5)
    assert p.parked == []
    p.park_gate = None
    reply = await c.handle("commit", {**stop, "deadline_ts": T0 + 30})
    assert reply["phase"] == "committed"
    assert p.parked == [["a-a1"]]
    assert p.release_calls == 1  # the release step done before is not repeated
    assert store.writes == 1


async def test_a_resume_between_the_failed_release_and_the_retry_ends_the_commit() -> None:
    c, p, _ = await restored_then_prepared()
    p.release_gate = asyncio.Event()
    with pytest.raises(DeadlineExceeded):
        await c.handle("commit", body_t0("c1", 0.05, checkpoint_dir="/new", episode_ids=SCOPE))
    await c.handle("resume", body_t0("c1"))
    with pytest.raises(StaleCheckpoint):
        await c.handle("commit", body_t0("c1", checkpoint_dir="/new", episode_ids=SCOPE))


async def test_a_state_that_would_not_come_back_the_same_fails_the_commit_closed() -> None:
    p = FakeParticipant()
    store = MemoryStore()
    settings = CheckpointSettings(enabled=True, control_auth_token="t")
    c = ParticipantEngine(
        p, instance="env0", settings=settings, clock=ManualClock(T0), store=store
    )
    p.start("r", at_boundary=True, state={"rng": [3, (1, 2)]})
    await c.handle("prepare", body_t0("c1"))
    with pytest.raises(InvalidCheckpointState, match=r"episode r: state.rng\[1\] is a tuple"):
        await c.handle("commit", body_t0("c1", checkpoint_dir="/ck"))
    assert store.writes == 0
    assert c.status()["phase"] == "prepared"
