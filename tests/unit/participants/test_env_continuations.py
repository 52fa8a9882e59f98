"""The environment server's `/run` at its edges (issue 23), over real loopback HTTP.

`ScriptedEnv` is the real `EnvironmentServer` with its downstream calls
answered in-process (a fake for the agent and resources servers only), so the
refusal and restore paths run through the real handler, steps table and
participant hooks.  The restart-only deadline test runs the whole reference
fleet in-process.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from participants.environment import task_digest
from participants.fleet import KIND_ORDER, FleetConfig
from participants.local import start_local_fleet
from participants.rollout import make_tasks, run_episode
from participants.servers.environment import EnvironmentServer
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.records.record import Record
from tests.unit.conftest import Serve
from tests.unit.helpers import body, until

TASK = {"task_id": "t", "seed": 7, "steps": 1}
OTHER = {"task_id": "u", "seed": 8, "steps": 1}
RESULT = {"task_id": "t", "steps": [{"turns": []}], "reward": 0.57, "verification": {}}


class ScriptedEnv(EnvironmentServer):
    def __init__(self) -> None:
        super().__init__("env", agent_url="http://unused", resources_url="http://unused")
        self.seeded: list[EpisodeId] = []

    async def seed(self, episode: EpisodeId, task: dict[str, Any]) -> tuple[str, dict[str, str]]:
        self.seeded.append(episode)
        return "obs", {"x-ng-checkpoint-verify": "wait"}

    async def activate(self, episode: EpisodeId, step: int, observation: str) -> Any:
        return {"step": step, "turns": []}

    async def verify(self, episode: EpisodeId, body: dict[str, Any]) -> dict[str, Any]:
        return {"reward": 0.0}

    async def close(self, episode: EpisodeId) -> None:
        return None


async def post_run(
    http: aiohttp.ClientSession, url: str, eid: EpisodeId, task: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    payload = {"episode_id": {"rollout_id": eid.rollout_id, "attempt": eid.attempt}, "task": task}
    async with http.post(f"{url}/run", json=payload) as resp:
        return resp.status, await resp.json()


async def test_a_continuation_for_another_task_is_refused_and_keeps_the_restored_state(
    serve: Serve, http: aiohttp.ClientSession
) -> None:
    env = ScriptedEnv()
    url = await serve(env.app())
    boundary = {"next": "return", "task_digest": task_digest(TASK), "result": RESULT}
    await env.participant.install([Record("r", {"boundary": boundary, "step": 3})])
    r1 = EpisodeId("r", 1)

    status, reply = await post_run(http, url, r1, OTHER)
    assert status == 400
    assert reply["error"]["code"] == "invalid_request"
    assert "different task" in reply["error"]["detail"]
    assert env.steps.restored_ids() == [r1]  # untouched by the refusal

    status, reply = await post_run(http, url, r1, TASK)
    assert status == 200
    assert reply["result"] == RESULT  # continued from the restored boundary
    assert env.seeded == []  # never restarted from seed
    assert env.steps.restored_ids() == []


@pytest.mark.parametrize("deadline", ["soon", True, 0, -1.5, [1]])
async def test_a_malformed_deadline_is_an_invalid_request(
    serve: Serve, http: aiohttp.ClientSession, deadline: Any
) -> None:
    env = ScriptedEnv()
    url = await serve(env.app())
    status, reply = await post_run(http, url, EpisodeId("r"), {**TASK, "deadline_s": deadline})
    assert status == 400
    assert reply["error"]["code"] == "invalid_request"
    assert env.seeded == []
    assert env.steps.fresh()  # nothing began
    status, reply = await post_run(http, url, EpisodeId("r"), {**TASK, "deadline_s": 30})
    assert status == 200
    assert "result" in reply


async def test_a_restart_only_episode_is_not_charged_for_a_checkpoint_held_open() -> None:
    # Uninterrupted the episode takes ~0.25 s; its deadline is 1 s; the
    # checkpoint stays open 2 s while its calls wait at the closed gates.
    config = FleetConfig(
        resources_mode="restart_only", step_delay_s=0.03, token_delay_s=0.005, turns_per_step=2
    )
    fleet = await start_local_fleet(config)
    task = {**make_tasks(1, steps=2, seed=5)[0], "deadline_s": 1.0}
    try:
        async with aiohttp.ClientSession() as http:
            env = fleet.server("environment")
            pending = asyncio.create_task(
                run_episode(http, fleet.urls["environment"], EpisodeId("r"), task)
            )
            # Marked a restart right after its seed step.
            await until(lambda: env.steps.report(5).restarts == ["r"])
            for kind in KIND_ORDER:
                reply = await fleet.engines[kind].handle("prepare", body("c1"))
                assert reply["phase"] == "prepared", (kind, reply)
            await asyncio.sleep(2.0)
            assert not pending.done()  # held at a downstream gate meanwhile
            for kind in reversed(KIND_ORDER):
                await fleet.engines[kind].handle("resume", body("c1"))
            reply = await pending
    finally:
        await fleet.stop()
    assert "result" in reply, reply


class SlowVerifyEnv(ScriptedEnv):
    async def verify(self, episode: EpisodeId, body: dict[str, Any]) -> dict[str, Any]:
        self.verifying.set()
        await asyncio.sleep(30)  # slower than the episode's budget
        return {"reward": 1.0}

    def __init__(self) -> None:
        super().__init__()
        self.verifying = asyncio.Event()


async def test_a_deadline_in_a_wait_verify_under_a_checkpoint_waits_for_resume(
    serve: Serve, http: aiohttp.ClientSession
) -> None:
    env = SlowVerifyEnv()
    url = await serve(env.app())
    task = {**TASK, "deadline_s": 0.3}
    pending = asyncio.create_task(post_run(http, url, EpisodeId("r"), task))
    await env.verifying.wait()
    env.participant.close_admission()  # prepare: the checkpoint waits for the verify
    await until(env.participant.ready)  # the deadline ran out inside it
    await asyncio.sleep(0.05)
    assert not pending.done()  # the failure does not leave while prepared
    (record,) = await env.participant.export([EpisodeId("r")])
    assert record.state["boundary"]["next"] == "verify"  # nothing silently dropped
    assert record.state["spent_s"] == pytest.approx(0.3)  # no budget left to stretch
    env.participant.open_admission()
    status, reply = await pending
    assert status == 200
    assert reply["failure"]["code"] == "deadline_exceeded"
