"""What the participant engine answers: for the ID asked about, and
`status.retiring` as the attempts being stopped right now."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ray_ckpt import EpisodeId, ManualClock
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.steps import EpisodeSteps
from ray_ckpt.steps.episode_participant import EpisodeParticipant
from tests.unit.fakes import FakeParticipant, MemoryStore
from tests.unit.helpers import T0, body_t0, until

SETTINGS = CheckpointSettings(enabled=True, control_auth_token="t")


def engine(participant: Any) -> ParticipantEngine:
    return ParticipantEngine(
        participant, instance="i", settings=SETTINGS, clock=ManualClock(T0), store=MemoryStore()
    )


async def test_an_idempotent_resume_answers_idle_for_its_id_while_another_is_open() -> None:
    p = FakeParticipant()
    c = engine(p)
    await c.handle("prepare", body_t0("c1"))
    await c.handle("resume", body_t0("c1"))
    assert (await c.handle("prepare", body_t0("c2")))["phase"] == "prepared"
    assert await c.handle("resume", body_t0("c1")) == {"phase": "idle", "idempotent": True}
    assert c.status()["phase"] == "prepared"  # c2 untouched
    assert not p.admission_open


async def test_an_interrupted_prepare_answers_for_its_own_id() -> None:
    p = FakeParticipant()
    p.start("slow")  # never at a boundary: every prepare waits
    c = engine(p)
    first = asyncio.create_task(c.handle("prepare", body_t0("c1")))
    await asyncio.sleep(0.02)
    # Queue a resume of c1 and then a prepare of c2 on the engine's lock,
    # so c2 opens before the interrupted prepare of c1 reads the state.
    await c._lock.acquire()
    resume = asyncio.create_task(c.handle("resume", body_t0("c1")))
    second = asyncio.create_task(c.handle("prepare", body_t0("c2", deadline=0.3)))
    await asyncio.sleep(0.02)
    c._lock.release()
    assert await asyncio.wait_for(resume, 2) == {"phase": "idle", "idempotent": False}
    reply = await asyncio.wait_for(first, 2)
    assert c.status()["checkpoint_id"] == "c2"  # c2 was open when c1's prepare answered
    assert reply["phase"] == "idle"  # c1 is over, whatever c2 is doing
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second


async def test_status_retiring_counts_the_attempts_being_stopped() -> None:
    steps = EpisodeSteps(clock=ManualClock(T0))
    c = engine(EpisodeParticipant("environment", steps))
    let_go = asyncio.Event()
    started = 0

    async def episode(eid: EpisodeId) -> None:
        nonlocal started
        async with steps.begin(eid) as ep:
            try:
                async with ep.step("replay", name="sandbox"):
                    started += 1
                    await asyncio.Event().wait()
            finally:
                await let_go.wait()  # a slow cleanup: the stop takes a while

    # Two live attempts; three retire requests (one retried) stop them.
    tasks = [asyncio.create_task(episode(EpisodeId(*k))) for k in (("r", 0), ("s", 0))]
    await until(lambda: started == 2)
    retire_r = body_t0("op1", episode_ids=[{"rollout_id": "r", "attempt": 0}])
    retire_s = body_t0("op2", episode_ids=[{"rollout_id": "s"}])
    calls = [
        asyncio.create_task(c.handle("retire", retire_r)),
        asyncio.create_task(c.handle("retire", retire_r)),  # a retried request: same attempt
        asyncio.create_task(c.handle("retire", retire_s)),
    ]
    await until(lambda: steps.retiring() == 2)
    assert c.status()["retiring"] == 2  # two attempts, not three request IDs
    # A retire call that gives up (its deadline) leaves the stops running:
    # they are still being stopped, and still counted.
    for call in calls:
        call.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    assert c.status()["retiring"] == 2
    let_go.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await until(lambda: c.status()["retiring"] == 0)
