"""The agent participant's `status.retiring` counts its stopping attempts,
not the retire calls in flight."""

from __future__ import annotations

import asyncio

from participants.agent import AgentParticipant
from ray_ckpt import EpisodeId, ManualClock
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.settings import CheckpointSettings
from tests.unit.fakes import MemoryStore
from tests.unit.helpers import T0, until


async def test_agent_status_retiring_counts_stops_that_outlive_their_call() -> None:
    agent = AgentParticipant(clock=ManualClock(T0))
    c = ParticipantEngine(
        agent,
        instance="a",
        settings=CheckpointSettings(enabled=True, control_auth_token="t"),
        clock=ManualClock(T0),
        store=MemoryStore(),
    )
    let_go = asyncio.Event()
    started = 0

    async def episode(eid: EpisodeId) -> None:
        nonlocal started
        async with agent.steps.begin(eid) as ep:
            try:
                async with ep.step("replay", name="turn"):
                    started += 1
                    await asyncio.Event().wait()
            finally:
                await let_go.wait()  # a slow cleanup: the stop takes a while

    tasks = [asyncio.create_task(episode(EpisodeId(r))) for r in ("r", "s")]
    await until(lambda: started == 2)
    body = {"checkpoint_id": "op", "deadline_ts": T0 + 30, "episode_ids": [
        {"rollout_id": "r"}, {"rollout_id": "s"}]}  # fmt: skip
    call = asyncio.create_task(c.handle("retire", body))
    await until(lambda: agent.steps.retiring() == 2)
    assert c.status()["retiring"] == 2
    call.cancel()  # the caller gives up; the stops go on
    await asyncio.gather(call, return_exceptions=True)
    assert c.status()["retiring"] == 2
    let_go.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await until(lambda: c.status()["retiring"] == 0)
