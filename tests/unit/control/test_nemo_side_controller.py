"""What NeMo Gym's controller needs from our participant engine (§1.18):
string blockers, a prepare past its deadline, a never-seen resume, the
straggler path's retire under a resumed ID, and retire marks that only rise."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ray_ckpt import EpisodeId, ManualClock
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import StaleAttempt, StaleCheckpoint
from ray_ckpt.reports import MAX_REPORTED_BLOCKERS, Blocker, PrepareReport
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.steps import EpisodeSteps
from ray_ckpt.steps.episode_participant import EpisodeParticipant
from tests.unit.fakes import FakeParticipant, MemoryStore
from tests.unit.helpers import T0, body_t0, until


def engine(participant: Any, clock: ManualClock | None = None) -> ParticipantEngine:
    return ParticipantEngine(
        participant,
        instance="i",
        settings=CheckpointSettings(enabled=True, control_auth_token="t"),
        clock=clock or ManualClock(T0),
        store=MemoryStore(),
    )


# --- report.blockers --------------------------------------------------------------


async def test_blockers_are_capture_key_strings_with_details_beside_them() -> None:
    p = FakeParticipant()
    keys = sorted(f"r{i:03d}" for i in range(150)) + ["z-a2"]
    for k in keys:
        p.start(k)
    c = engine(p)
    prepare = await c.handle("prepare", body_t0("c1", deadline=-1))  # answers at once
    for report in (c.status()["report"], prepare["report"]):
        assert report["blocker_count"] == len(keys)  # the full count
        assert report["blockers"] == keys[:MAX_REPORTED_BLOCKERS]  # capped, strings
        details = report["blocker_details"]
        assert [d["key"] for d in details] == report["blockers"]  # same cap, same order
        assert {d["state"] for d in details} == {"running"}
        # NeMo Gym's straggler path turns each one back into an episode.
        assert all(EpisodeId.from_capture_key(k).capture_key == k for k in report["blockers"])


class Uncapped(FakeParticipant):
    """A participant whose report ignores the limit it is given."""

    def report(self, limit: int) -> PrepareReport:
        blockers = [Blocker(key=f"r{i:03d}", state="running") for i in range(120)]
        return PrepareReport(ready=False, blockers=blockers)


async def test_the_reply_caps_blockers_whatever_the_participant_lists() -> None:
    report = engine(Uncapped()).status()["report"]
    assert len(report["blockers"]) == len(report["blocker_details"]) == MAX_REPORTED_BLOCKERS
    assert report["blocker_count"] == 120  # never below what it listed


async def test_episode_steps_blockers_over_the_straggler_path() -> None:
    steps = EpisodeSteps(clock=ManualClock(T0))
    c = engine(EpisodeParticipant("environment", steps))
    started = 0

    async def episode(eid: EpisodeId) -> None:
        nonlocal started
        async with steps.begin(eid) as ep, ep.step("wait", name="sandbox"):
            started += 1
            await asyncio.Event().wait()

    tasks = [asyncio.create_task(episode(e)) for e in (EpisodeId("r0"), EpisodeId("r1", 2))]
    await until(lambda: started == 2)
    reply = await c.handle("prepare", body_t0("c1", deadline=-1))
    assert reply["phase"] == "preparing"
    assert reply["report"]["blockers"] == ["r0", "r1-a2"]
    assert reply["report"]["blocker_details"][1]["detail"] == "sandbox"
    # resume (abort), then retire each blocker's episode under the same ID.
    await c.handle("resume", body_t0("c1"))
    stragglers = [EpisodeId.from_capture_key(k) for k in reply["report"]["blockers"]]
    retire = body_t0("c1", episode_ids=[{"rollout_id": e.rollout_id, "attempt": e.attempt}
                                     for e in stragglers])  # fmt: skip
    assert (await c.handle("retire", retire))["retired"] == ["r0", "r1-a2"]
    await asyncio.gather(*tasks, return_exceptions=True)
    assert steps.live_executions() == 0


# --- prepare past its deadline ----------------------------------------------------


async def test_a_ready_participant_past_the_deadline_is_prepared() -> None:
    p = FakeParticipant()
    p.start("r1", at_boundary=True)
    c = engine(p)
    reply = await c.handle("prepare", body_t0("c1", deadline=-5))  # skewed clocks
    assert reply["phase"] == "prepared" and reply["report"]["ready"]
    assert not p.admission_open and c.status()["phase"] == "prepared"
    assert await c.handle("prepare", body_t0("c1", deadline=-5)) == reply  # replayed
    await c.handle("commit", body_t0("c1", checkpoint_dir="/d"))  # and it commits
    assert c.status()["phase"] == "committed"


async def test_a_busy_participant_past_the_deadline_answers_preparing_closed() -> None:
    p = FakeParticipant()
    p.start("slow")
    c = engine(p)
    reply = await c.handle("prepare", body_t0("c1", deadline=-1))
    assert reply["phase"] == "preparing"
    assert reply["report"]["blockers"] == ["slow"]
    assert not p.admission_open  # admission stays closed, as NeMo Gym's
    assert c.status()["phase"] == "preparing"
    assert (await c.handle("resume", body_t0("c1")))["idempotent"] is False
    assert p.admission_open


# --- resume of a never-seen ID ------------------------------------------------------


async def test_resume_of_a_never_seen_id_while_idle_is_idempotent_and_fences() -> None:
    p = FakeParticipant()
    c = engine(p)
    assert await c.handle("resume", body_t0("never")) == {"phase": "idle", "idempotent": True}
    with pytest.raises(StaleCheckpoint):
        await c.handle("prepare", body_t0("never"))  # the delayed prepare is refused
    assert p.admission_open and c.status()["phase"] == "idle"


# --- retire under a resumed ID; marks only rise ----------------------------------


async def test_a_delayed_retire_never_lowers_a_mark_nor_stops_a_later_attempt() -> None:
    steps = EpisodeSteps(clock=ManualClock(T0))
    c = engine(EpisodeParticipant("environment", steps))
    running: set[str] = set()

    async def episode(eid: EpisodeId) -> None:
        async with steps.begin(eid) as ep, ep.step("wait", name="sandbox"):
            running.add(eid.capture_key)
            await asyncio.Event().wait()

    first = asyncio.create_task(episode(EpisodeId("r")))
    await until(lambda: "r" in running)
    assert (await c.handle("prepare", body_t0("c1", deadline=-1)))["phase"] == "preparing"
    await c.handle("resume", body_t0("c1"))
    r0 = body_t0("c1", episode_ids=[{"rollout_id": "r", "attempt": 0}])
    assert (await c.handle("retire", r0))["retired"] == ["r"]  # the straggler path
    await asyncio.gather(first, return_exceptions=True)

    # Attempt 1 is re-dispatched and runs; the same retire arrives again, late.
    second = asyncio.create_task(episode(EpisodeId("r", 1)))
    await until(lambda: "r-a1" in running)
    await c.handle("retire", r0)
    assert not second.done() and steps.live_executions() == 1  # attempt 1 untouched
    c.retired.check(EpisodeId("r", 1))  # and its data calls are served
    with pytest.raises(StaleAttempt):
        c.retired.check(EpisodeId("r", 0))

    # A mark at attempt 1, then a delayed retire of attempt 0: the mark stays at 1.
    r1 = body_t0("op", episode_ids=[{"rollout_id": "r", "attempt": 1}])
    assert (await c.handle("retire", r1))["retired"] == ["r-a1"]
    await asyncio.gather(second, return_exceptions=True)
    await c.handle("retire", r0)
    with pytest.raises(StaleAttempt):
        c.retired.check(EpisodeId("r", 1))
    c.retired.check(EpisodeId("r", 2))
    assert c.status()["retired_rollouts"] == 1


async def test_inside_an_open_checkpoint_a_resumed_id_stays_stale_for_retire() -> None:
    c = engine(FakeParticipant())
    await c.handle("prepare", body_t0("c1"))
    await c.handle("resume", body_t0("c1"))
    await c.handle("prepare", body_t0("c2"))  # another checkpoint is open
    for op, extra in (("retire", {"episode_ids": [{"rollout_id": "x"}]}),
                      ("forget", {"rollout_ids": ["x"]})):  # fmt: skip
        with pytest.raises(StaleCheckpoint):
            await c.handle(op, body_t0("c1", **extra))
    await c.handle("resume", body_t0("c2"))
    assert await c.handle("forget", body_t0("c1", rollout_ids=["x"])) == {"forgotten": []}
