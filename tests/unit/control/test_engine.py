"""The participant engine over a fake participant and an in-memory store."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from ray_ckpt import EpisodeId, ManualClock, Record
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import (
    CheckpointConflict,
    DeadlineExceeded,
    InvalidPhase,
    InvalidRequest,
    RestartInScope,
    StaleAttempt,
    StaleCheckpoint,
)
from ray_ckpt.settings import CheckpointSettings
from tests.unit.fakes import FakeParticipant, Manifest, MemoryStore
from tests.unit.helpers import T0, body_t0, until


def make(
    grace: float = 600.0, participant: FakeParticipant | None = None
) -> tuple[ParticipantEngine, FakeParticipant, MemoryStore, ManualClock]:
    p = participant or FakeParticipant()
    store = MemoryStore()
    clock = ManualClock(T0)
    settings = CheckpointSettings(enabled=True, control_auth_token="t", lease_grace_seconds=grace)
    c = ParticipantEngine(p, instance="env0", settings=settings, clock=clock, store=store)
    return c, p, store, clock


async def test_prepare_waits_for_boundaries_then_replays_identically() -> None:
    c, p, _, _ = make()
    p.start("r1")
    task = asyncio.create_task(c.handle("prepare", body_t0("c1")))
    await asyncio.sleep(0.05)
    assert not task.done() and not p.admission_open
    assert c.status()["phase"] == "preparing"
    p.reach_boundary("r1", {"next": "verify"})
    first = await asyncio.wait_for(task, 2)
    assert first["phase"] == "prepared" and first["report"]["ready"]
    assert await c.handle("prepare", body_t0("c1")) == first


async def test_prepare_at_deadline_reports_blockers_and_stays_closed() -> None:
    c2, p2, _, clock = make()
    p2.start("r1")
    task = asyncio.create_task(c2.handle("prepare", body_t0("c1", deadline=5)))
    await asyncio.sleep(0.02)
    clock.advance(6)
    c2.notify()
    reply = await asyncio.wait_for(task, 2)
    assert reply["phase"] == "preparing"
    assert reply["report"]["blocker_count"] == 1
    # NeMo Gym's shape: capture-key strings; our objects under blocker_details.
    assert reply["report"]["blockers"] == ["r1"]
    assert reply["report"]["blocker_details"] == [
        {"key": "r1", "state": "running", "step": None, "mode": None, "running_s": None,
         "detail": ""}
    ]  # fmt: skip
    assert not p2.admission_open


async def test_resume_interrupts_a_waiting_prepare_and_fences_the_id() -> None:
    c, p, _, _ = make()
    p.start("r1")
    task = asyncio.create_task(c.handle("prepare", body_t0("c1")))
    await asyncio.sleep(0.02)
    assert await c.handle("resume", body_t0("c1")) == {"phase": "idle", "idempotent": False}
    assert (await asyncio.wait_for(task, 2))["phase"] == "idle"
    assert p.admission_open
    with pytest.raises(StaleCheckpoint):
        await c.handle("prepare", body_t0("c1"))
    assert await c.handle("resume", body_t0("c1")) == {"phase": "idle", "idempotent": True}


async def test_resume_of_an_unseen_id_refuses_its_delayed_prepare() -> None:
    c, p, _, _ = make()
    await c.handle("resume", body_t0("never-seen"))
    with pytest.raises(StaleCheckpoint):
        await c.handle("prepare", body_t0("never-seen"))
    assert p.admission_open and c.status()["phase"] == "idle"


async def test_second_id_conflicts_while_one_is_open() -> None:
    c, _, _, _ = make()
    await c.handle("prepare", body_t0("c1"))
    with pytest.raises(CheckpointConflict):
        await c.handle("prepare", body_t0("c2"))
    with pytest.raises(CheckpointConflict):
        await c.handle("resume", body_t0("c2"))


async def test_failed_close_reopens_admission() -> None:
    c, p, _, _ = make()
    p.fail_close = True
    with pytest.raises(RuntimeError):
        await c.handle("prepare", body_t0("c1"))
    assert c.status()["phase"] == "idle" and p.admission_open
    p.fail_close = False
    assert (await c.handle("prepare", body_t0("c1")))["phase"] == "prepared"


async def test_bad_bodies_change_nothing() -> None:
    c, p, _, _ = make()
    for bad in (b"{", b'{"checkpoint_id":"c1"}', b'{"checkpoint_id":"-x","deadline_ts":1}'):
        with pytest.raises(InvalidRequest):
            await c.handle("prepare", bad)
    with pytest.raises(InvalidRequest):
        await c.handle("prepare", {"checkpoint_id": "c1", "deadline_ts": T0 + 5, "x": 1})
    with pytest.raises(InvalidRequest):
        await c.handle("prepare", {"checkpoint_id": "c1", "deadline_ts": float("nan")})
    assert c.status()["phase"] == "idle" and p.admission_open


async def test_commit_writes_once_and_replays() -> None:
    c, p, store, _ = make()
    p.start("r1", at_boundary=True, state={"next": "tool", "x": [1, 2]})
    await c.handle("prepare", body_t0("c1"))
    reply = await c.handle("commit", body_t0("c1", checkpoint_dir="/ck"))
    assert reply["phase"] == "committed" and reply["episode_ids"] == ["r1"]
    assert reply["manifest"]["record_count"] == 1
    assert await c.handle("commit", body_t0("c1", checkpoint_dir="/ck")) == reply
    assert store.writes == 1
    with pytest.raises(CheckpointConflict):
        await c.handle("commit", body_t0("c1", checkpoint_dir="/other"))


async def test_commit_refuses_a_participant_that_is_no_longer_ready() -> None:
    c, p, store, _ = make()
    await c.handle("prepare", body_t0("c1"))
    p.start("late")  # readiness regressed (prepared out of order)
    with pytest.raises(InvalidPhase, match="no longer ready"):
        await c.handle("commit", body_t0("c1", checkpoint_dir="/ck"))
    assert store.writes == 0 and store.data == {}


async def test_commit_deadline_then_retry_awaits_the_same_write() -> None:
    c, p, store, clock = make()
    p.start("r1", at_boundary=True, state=1)
    await c.handle("prepare", body_t0("c1"))
    store.write_gate = threading.Event()
    with pytest.raises(DeadlineExceeded):
        await c.handle("commit", {**body_t0("c1", checkpoint_dir="/ck"), "deadline_ts": T0 + 0.1})
    store.write_gate.set()
    reply = await c.handle("commit", body_t0("c1", checkpoint_dir="/ck"))
    assert reply["phase"] == "committed" and store.writes == 1


async def test_resume_stops_a_write_so_nothing_publishes() -> None:
    c, p, store, _ = make()
    p.start("r1", at_boundary=True, state=1)
    await c.handle("prepare", body_t0("c1"))
    store.write_gate = threading.Event()
    commit = asyncio.create_task(c.handle("commit", body_t0("c1", checkpoint_dir="/ck")))
    await asyncio.sleep(0.05)
    resume = asyncio.create_task(c.handle("resume", body_t0("c1")))
    await asyncio.sleep(0.05)
    store.write_gate.set()
    await resume
    with pytest.raises(Exception, match="stopped"):
        await commit
    assert store.data == {}


async def test_commit_scope_releases_unclaimed_restored_state() -> None:
    c, p, store, _ = make()
    store.data[("/old", "environment", "env0")] = (
        Manifest("c0", "environment", "env0", 2),
        [Record("a", 1), Record("b-a1", 2)],
    )
    restored = await c.handle(
        "restore",
        body_t0(
            "c0",
            checkpoint_dir="/old",
            episode_ids=[{"rollout_id": "a"}, {"rollout_id": "b", "attempt": 1}],
        ),
    )
    assert restored == {
        "phase": "restored",
        "source_checkpoint_id": "c0",
        "restored": ["a-a1", "b-a2"],
    }
    await c.handle("resume", body_t0("c0"))
    await c.handle("prepare", body_t0("c1"))
    reply = await c.handle(
        "commit",
        body_t0("c1", checkpoint_dir="/new", episode_ids=[{"rollout_id": "a", "attempt": 1}]),
    )
    assert reply["episode_ids"] == ["a-a1"]
    assert p.deleted == ["b-a2"] and list(p.restored) == ["a-a1"]


async def test_scope_naming_a_restart_fails_closed() -> None:
    c, p, store, _ = make()
    p.start("r1", at_boundary=True)
    p.restarts.add("r1")
    await c.handle("prepare", body_t0("c1"))
    with pytest.raises(RestartInScope):
        await c.handle(
            "commit", body_t0("c1", checkpoint_dir="/ck", episode_ids=[{"rollout_id": "r1"}])
        )
    assert store.writes == 0


async def test_restore_only_in_a_fresh_process_and_once() -> None:
    c, p, store, _ = make()
    p.start("r1", at_boundary=True, state="s")
    await c.handle("prepare", body_t0("c1"))
    await c.handle("commit", body_t0("c1", checkpoint_dir="/ck"))
    await c.handle("resume", body_t0("c1"))
    with pytest.raises(InvalidPhase, match="fresh"):
        await c.handle(
            "restore", body_t0("c2", checkpoint_dir="/ck", episode_ids=[{"rollout_id": "r1"}])
        )
    fresh, fp, _, _ = make()
    fresh.store = store
    reply = await fresh.handle(
        "restore", body_t0("c1", checkpoint_dir="/ck", episode_ids=[{"rollout_id": "r1"}])
    )
    assert reply == {"phase": "restored", "source_checkpoint_id": "c1", "restored": ["r1-a1"]}
    assert fp.restored == {"r1-a1": "s"} and not fp.admission_open
    assert (
        await fresh.handle(
            "restore", body_t0("c1", checkpoint_dir="/ck", episode_ids=[{"rollout_id": "r1"}])
        )
        == reply
    )
    await fresh.handle("resume", body_t0("c1"))
    assert fp.admission_open
    with pytest.raises(InvalidPhase):
        await fresh.handle("restore", body_t0("c3", checkpoint_dir="/ck", episode_ids=[]))


async def test_restore_installs_only_the_episodes_in_scope() -> None:
    c, p, store, _ = make()
    p.start("a", at_boundary=True, state=1)
    p.start("b-a2", at_boundary=True, state=2)
    await c.handle("prepare", body_t0("c1"))
    await c.handle("commit", body_t0("c1", checkpoint_dir="/ck"))
    fresh, fp, _, _ = make()
    fresh.store = store
    reply = await fresh.handle(
        "restore",
        body_t0("c1", checkpoint_dir="/ck", episode_ids=[{"rollout_id": "b", "attempt": 2}]),
    )
    assert reply["restored"] == ["b-a3"] and list(fp.restored) == ["b-a3"]


async def test_lease_expiry_resumes_by_itself_at_the_exact_time() -> None:
    c, p, _, clock = make(grace=10.0)
    p.start("r1", at_boundary=True)
    await c.handle("prepare", body_t0("c1", deadline=0.05))
    assert c.state.lease_expires_at == T0 + 0.05 + 10.0
    clock.set(T0 + 10.04)
    assert not await c.check_lease()
    await c.handle("renew", body_t0("c1", deadline=20))
    clock.set(T0 + 30.0 - 1e-6)
    assert not await c.check_lease()
    clock.set(T0 + 30.0)
    assert await c.check_lease()
    status = c.status()
    assert status["phase"] == "idle" and status["lease_expires_at"] is None
    assert p.admission_open
    with pytest.raises(StaleCheckpoint):
        await c.handle("commit", body_t0("c1", checkpoint_dir="/ck"))


async def test_lease_watcher_task_resumes_with_real_time() -> None:
    from ray_ckpt.clock import SystemClock

    p = FakeParticipant()
    settings = CheckpointSettings(enabled=True, control_auth_token="t", lease_grace_seconds=0.2)
    c = ParticipantEngine(
        p, instance="i", settings=settings, clock=SystemClock(), store=MemoryStore()
    )
    c.start()
    try:
        import time

        await c.handle("prepare", {"checkpoint_id": "c1", "deadline_ts": time.time() + 0.05})
        assert c.status()["phase"] == "prepared"
        # The lease ends 0.25 s on; polled, as a loaded machine may run the
        # watcher late.
        await until(lambda: c.status()["phase"] == "idle")
        assert p.admission_open
    finally:
        await c.aclose()


async def test_retire_marks_first_replies_after_stop_and_frees() -> None:
    c, p, _, _ = make()
    p.start("r", at_boundary=True)
    p.start("r-a1")
    p.retire_gate = asyncio.Event()
    before = len(p.live)
    task = asyncio.create_task(
        c.handle("retire", body_t0("op1", episode_ids=[{"rollout_id": "r", "attempt": 1}]))
    )
    await asyncio.sleep(0.02)
    assert not task.done()
    assert c.status()["retiring"] == 1
    with pytest.raises(StaleAttempt):
        c.retired.check(EpisodeId("r", 1))  # refused while stopping
    p.retire_gate.set()
    reply = await asyncio.wait_for(task, 2)
    assert reply == {"retired": ["r", "r-a1"]}
    assert len(p.live) == before - 2 and c.status()["retiring"] == 0
    with pytest.raises(StaleAttempt):
        c.retired.check(EpisodeId("r", 0))  # late data call still refused
    c.retired.check(EpisodeId("r", 2))  # a newer attempt is fine
    assert c.status()["retired_rollouts"] == 1
    assert await c.handle("forget", body_t0("op2", rollout_ids=["r", "zz"])) == {"forgotten": ["r"]}
    assert c.status()["retired_rollouts"] == 0


async def test_straggler_retired_after_resume_not_while_open() -> None:
    c, p, _, clock = make()
    p.start("slow")
    prepare = asyncio.create_task(c.handle("prepare", body_t0("c1", deadline=1)))
    await asyncio.sleep(0.02)
    clock.advance(2)
    c.notify()
    assert (await asyncio.wait_for(prepare, 2))["phase"] == "preparing"
    with pytest.raises(InvalidPhase):
        await c.handle("retire", body_t0("c1", deadline=30, episode_ids=[{"rollout_id": "slow"}]))
    assert "slow" in p.live
    await c.handle("resume", body_t0("c1"))
    # NeMo Gym's straggler path: resume, then retire under the same ID.
    retire = body_t0("c1", deadline=30, episode_ids=[{"rollout_id": "slow"}])
    assert (await c.handle("retire", retire))["retired"] == ["slow"]
    # ... and the resumed ID still fences everything that could reopen it.
    with pytest.raises(StaleCheckpoint):
        await c.handle("prepare", body_t0("c1", deadline=30))
    assert (await c.handle("prepare", body_t0("c2", deadline=30)))["phase"] == "prepared"


async def test_commit_with_stop_parks_exported_state_best_effort() -> None:
    c, p, _, _ = make()
    parked: list[list[str]] = []

    async def park_exported(records: list[Record]) -> None:
        parked.append([r.key for r in records])
        raise RuntimeError("sandbox API down")  # only logged

    p.park_exported = park_exported  # type: ignore[attr-defined]
    p.start("r1", at_boundary=True, state=1)
    await c.handle("prepare", body_t0("c1"))
    await c.handle("commit", body_t0("c1", checkpoint_dir="/a"))
    assert parked == []  # no stop: nothing parked
    await c.handle("resume", body_t0("c1"))
    await c.handle("prepare", body_t0("c2"))
    reply = await c.handle("commit", body_t0("c2", checkpoint_dir="/b", stop=True))
    assert reply["phase"] == "committed" and parked == [["r1"]]


async def test_an_install_outliving_its_restore_is_awaited_by_retire_and_resume() -> None:
    c, p, store, _ = make()
    store.data[("/ck", "environment", "env0")] = (
        Manifest("c0", "environment", "env0", 1),
        [Record("r", 1)],
    )
    gate = asyncio.Event()
    real_install = p.install

    async def slow_install(records: Any) -> Any:
        await gate.wait()
        return await real_install(records)

    p.install = slow_install  # type: ignore[method-assign]
    with pytest.raises(DeadlineExceeded):
        await c.handle(
            "restore",
            {
                **body_t0("c0", checkpoint_dir="/ck", episode_ids=[{"rollout_id": "r"}]),
                "deadline_ts": T0 + 0.1,
            },
        )
    assert c.status()["phase"] == "restored" and not p.admission_open
    retire = asyncio.create_task(
        c.handle("retire", body_t0("c0", episode_ids=[{"rollout_id": "r", "attempt": 1}]))
    )
    await asyncio.sleep(0.05)
    assert not retire.done()  # waits for the install before freeing
    gate.set()
    assert (await asyncio.wait_for(retire, 2))["retired"] == ["r-a1"]
    assert p.restored == {}
    await c.handle("resume", body_t0("c0"))
    assert p.admission_open and c.status()["phase"] == "idle"


async def test_a_retried_commit_restarts_a_write_that_was_cancelled() -> None:
    c, p, store, _ = make()
    p.start("r1", at_boundary=True, state=1)
    await c.handle("prepare", body_t0("c1"))
    store.write_gate = threading.Event()
    with pytest.raises(DeadlineExceeded):
        await c.handle("commit", {**body_t0("c1", checkpoint_dir="/ck"), "deadline_ts": T0 + 0.1})
    task = c._writes["c1"].task
    assert task is not None
    task.cancel()
    store.write_gate.set()
    await asyncio.sleep(0.05)
    reply = await c.handle("commit", body_t0("c1", checkpoint_dir="/ck"))
    assert reply["phase"] == "committed" and reply["episode_ids"] == ["r1"]


async def test_status_counts_the_write_in_flight_and_the_reply_has_its_slices() -> None:
    c, p, store, _ = make()
    p.start("r1", at_boundary=True, state=1)
    await c.handle("prepare", body_t0("c1"))
    assert c.status()["writes_in_flight"] == 0
    store.write_gate = threading.Event()
    commit = asyncio.create_task(c.handle("commit", body_t0("c1", checkpoint_dir="/ck")))
    for _ in range(100):  # until the store's thread holds the write
        if store.writes:
            break
        await asyncio.sleep(0.01)
    assert c.status()["writes_in_flight"] == 1
    store.write_gate.set()
    reply = await commit
    assert c.status()["writes_in_flight"] == 0
    # What the commit did, in order, for the coordinator's timeline.
    spans = reply["spans"]
    assert [s["name"] for s in spans] == ["capture", "write", "release"]
    assert all(s["start"] <= s["end"] for s in spans)
