"""The reference fleet as ParticipantHost actors on the shared local Ray.

Episodes run uninterrupted, then again with the same seeds; a checkpoint lands
while generations and tool calls are in flight, every host is `ray.kill`ed, a
fresh fleet under the same names restores and continues each episode as
attempt 1, and every field of every result equals the uninterrupted run's.
Retiring the continued attempts then frees everything the fleet held.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import ray

from participants.fleet import Fleet, FleetConfig, launch_fleet
from participants.rollout import make_tasks, result_digest, run_episode
from ray_ckpt.identity import EpisodeId

pytestmark = pytest.mark.ray

TASKS = make_tasks(3, steps=2, seed=11)


def body(cid: str, **extra: Any) -> dict[str, Any]:
    return {"checkpoint_id": cid, "deadline_ts": time.time() + 30, **extra}


def ids(episodes: list[EpisodeId]) -> list[dict[str, Any]]:
    return [{"rollout_id": e.rollout_id, "attempt": e.attempt} for e in episodes]


async def stats(http: aiohttp.ClientSession, fleet: Fleet, kind: str) -> dict[str, Any]:
    async with http.get(fleet.urls[kind] + "/stats") as resp:
        reply: dict[str, Any] = await resp.json()
        return reply


async def test_a_killed_fleet_restores_and_continues_to_the_uninterrupted_results(
    namespace: str, tmp_path: Path
) -> None:
    config = FleetConfig(
        namespace=namespace,
        token="fleet-test-token",
        step_delay_s=0.05,
        token_delay_s=0.01,
        tokens_per_turn=6,
        turns_per_step=2,
        suffix="t",
    )
    fleet = await launch_fleet(config)
    new: Fleet | None = None
    try:
        assert fleet.names == {
            "environment": "environment/ref-environment-t",
            "model": "model/ref-model-t",
            "agent": "agent/ref-agent-t",
            "resources": "resources/ref-resources-t",
        }
        async with aiohttp.ClientSession() as http:
            env_url = fleet.urls["environment"]
            base = await asyncio.gather(
                *(run_episode(http, env_url, EpisodeId(f"base{i}"), t) for i, t in enumerate(TASKS))
            )
            expected = [reply["result"] for reply in base]
            episodes = [EpisodeId(f"r{i}") for i in range(len(TASKS))]

            async def staggered(i: int) -> dict[str, Any]:
                # Offset starts, so one episode generates while another is in a tool call.
                await asyncio.sleep(0.03 * i)
                return await run_episode(http, env_url, episodes[i], TASKS[i])

            runs = [asyncio.create_task(staggered(i)) for i in range(len(TASKS))]
            async with asyncio.timeout(20):
                while True:
                    model = await stats(http, fleet, "model")
                    resources = await stats(http, fleet, "resources")
                    tools = resources["inflight_by_route"]
                    # A generation well short of its 6 tokens, so the cut has a prefix.
                    midway = any(1 <= n <= 3 for n in model["in_flight_tokens"])
                    if midway and (tools.get("guess") or tools.get("hint")):
                        break
                    await asyncio.sleep(0.005)

            for kind, host in fleet.ordered():
                reply = await host.prepare.remote(body("c1"))
                assert reply["phase"] == "prepared", (kind, reply)
            commit = body("c1", checkpoint_dir=str(tmp_path), episode_ids=ids(episodes))
            replies = await asyncio.gather(*(h.commit.remote(commit) for _, h in fleet.ordered()))
            assert all(r["phase"] == "committed" for r in replies)
            assert sorted(replies[0]["episode_ids"]) == ["r0", "r1", "r2"]  # environment

            assert (await stats(http, fleet, "model"))["counts"]["cut"] >= 1
            fleet.kill()
            results = await asyncio.gather(*runs, return_exceptions=True)
            assert all(isinstance(r, BaseException) for r in results)

            new = await launch_fleet(config)
            assert new.names == fleet.names
            restore = body("c1", checkpoint_dir=str(tmp_path), episode_ids=ids(episodes))
            restored = await asyncio.gather(*(h.restore.remote(restore) for _, h in new.ordered()))
            assert restored[0]["restored"] == ["r0-a1", "r1-a1", "r2-a1"]
            for _, host in reversed(new.ordered()):
                await host.resume.remote(body("c1"))

            env_url = new.urls["environment"]
            continued = await asyncio.gather(
                *(
                    run_episode(http, env_url, e.next(), t)
                    for e, t in zip(episodes, TASKS, strict=True)
                )
            )
            for reply, want in zip(continued, expected, strict=True):
                assert reply["result"] == want
                assert result_digest(reply["result"]) == result_digest(want)

            # Work cut before the crash was continued, not redone from scratch.
            model = await stats(http, new, "model")
            agent = await stats(http, new, "agent")
            assert model["counts"].get("calls_continued", 0) >= 1
            assert agent["tool_calls"] < 3 * 4

            retire = body("ret", episode_ids=ids([e.next() for e in episodes]))
            for group in (("environment",), ("agent",), ("model", "resources")):
                await asyncio.gather(*(new.hosts[k].retire.remote(retire) for k in group))
            model = await stats(http, new, "model")
            assert (model["live_calls"], model["ledgers"], model["restored_cuts"]) == (0, 0, 0)
            assert (await stats(http, new, "agent"))["sessions"] == 0
            assert (await stats(http, new, "resources"))["sessions"] == 0
            env = await stats(http, new, "environment")
            assert (env["live_episodes"], env["restored_episodes"]) == (0, 0)
            status = await new.hosts["environment"].status.remote()
            assert status["retired_rollouts"] == 3
    finally:
        if new is not None:
            await new.stop(timeout_s=10)
        for handle in fleet.hosts.values():
            ray.kill(handle, no_restart=True)
