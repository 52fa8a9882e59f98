"""A restore aimed at the running reference fleet (as `ray-ckpt restore DIR`
against the demo's) is refused by the coordinator before any participant
changes anything: typed, naming the members that have served, and the
rollouts in flight finish as if it had never been asked."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
import pytest
import ray

from coordination import connect
from coordination.actor.actor_options import COORDINATOR_NAME
from participants.fleet import FleetConfig, launch_fleet
from participants.rollout import make_tasks, run_episode
from ray_ckpt.errors import ParticipantNotFresh
from ray_ckpt.identity import EpisodeId

pytestmark = pytest.mark.ray

TASKS = make_tasks(2, steps=8, seed=5)  # long enough to be cut mid-rollout


async def test_a_restore_aimed_at_the_running_fleet_is_refused_and_its_rollouts_finish(
    namespace: str, tmp_path: Path
) -> None:
    config = FleetConfig(
        namespace=namespace,
        token="live-fleet-token",
        step_delay_s=0.05,
        token_delay_s=0.01,
        tokens_per_turn=6,
        turns_per_step=2,
        suffix="live",
    )
    fleet = await launch_fleet(config)
    try:
        gym = connect(namespace=namespace, state_dir=str(tmp_path / "state"))
        assert len((await gym.astatus()).participants) == 4  # discovered before any rollout
        async with aiohttp.ClientSession() as http:
            env_url = fleet.urls["environment"]
            runs = [
                asyncio.create_task(run_episode(http, env_url, EpisodeId(f"r{i}"), t))
                for i, t in enumerate(TASKS)
            ]
            async with asyncio.timeout(30):  # both rollouts under way
                while True:
                    async with http.get(env_url + "/stats") as resp:
                        if (await resp.json())["live_episodes"] == len(TASKS):
                            break
                    await asyncio.sleep(0.01)
            where = str(tmp_path / "step-1")
            episodes = [EpisodeId(f"r{i}") for i in range(len(TASKS))]
            done = await gym.acheckpoint(where, episodes)
            assert done.continued == ["r0", "r1"]  # taken mid-rollout

            with pytest.raises(ParticipantNotFresh) as info:
                await gym.arestore(where)  # every episode the checkpoint lists
            assert info.value.code == "not_fresh"
            assert "environment/ref-environment-live" in info.value.detail

            # Nothing open, admission open: the rollouts in flight finish.
            status = await gym.astatus()
            assert status.open_checkpoint is None
            async with asyncio.timeout(60):
                finished = await asyncio.gather(*runs)
            assert all("result" in reply for reply in finished)
            env = await fleet.hosts["environment"].status.remote()
            assert env["retired_rollouts"] == 0  # the refused restore retired nothing
    finally:
        with contextlib.suppress(ValueError):  # the coordinator connect() made
            ray.kill(ray.get_actor(COORDINATOR_NAME, namespace=namespace), no_restart=True)
        await fleet.stop(timeout_s=10)
