"""After a restore installs attempt N + 1, every kind's data plane refuses
attempts <= N with `stale_attempt` (409) until `forget`.

The reference fleet in-process on loopback with real engines and real
files: a checkpoint mid-episode, the fleet thrown away, a fresh one restored.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from participants.fleet import KIND_ORDER, FleetConfig
from participants.local import LocalFleet, start_local_fleet
from participants.rollout import make_tasks, run_episode
from ray_ckpt.identity import EpisodeId
from tests.unit.helpers import body, until

TASK = make_tasks(1, steps=2, seed=3)[0]
FAST = FleetConfig(step_delay_s=0.05, token_delay_s=0.01, tokens_per_turn=6, turns_per_step=2)
SCOPE = [{"rollout_id": "r", "attempt": 0}]


async def post(http: aiohttp.ClientSession, url: str, data: Any) -> tuple[int, Any]:
    async with http.post(url, json=data) as resp:
        return resp.status, await resp.json()


def late_calls(fleet: LocalFleet, key: str, attempt: int) -> list[tuple[str, dict[str, Any]]]:
    episode = {"rollout_id": "r", "attempt": attempt}
    return [
        (fleet.urls["environment"] + "/run", {"episode_id": episode, "task": TASK}),
        (fleet.urls["model"] + f"/ng-rollout/{key}/v1/responses", {"input": ["x"]}),
        (fleet.urls["agent"] + f"/ng-rollout/{key}/activate", {"step": 0, "observation": "o"}),
        (fleet.urls["resources"] + f"/ng-rollout/{key}/seed_session", {"task_id": "t", "seed": 1}),
        (fleet.urls["resources"] + f"/ng-rollout/{key}/guess", {"value": 3}),
    ]


async def checkpoint_mid_episode(http: aiohttp.ClientSession, where: Path) -> None:
    old = await start_local_fleet(FAST)
    try:
        run = asyncio.create_task(run_episode(http, old.urls["environment"], EpisodeId("r"), TASK))
        await until(lambda: old.server("model").stats()["ledger_entries"] >= 1)
        for kind in KIND_ORDER:
            reply = await old.engines[kind].handle("prepare", body("c1"))
            assert reply["phase"] == "prepared", (kind, reply)
        for kind in KIND_ORDER:
            await old.engines[kind].handle(
                "commit", body("c1", checkpoint_dir=str(where), episode_ids=SCOPE)
            )
        run.cancel()
    finally:
        await old.stop()  # the crash: nothing resumes


async def test_a_restored_rollout_refuses_its_older_attempts_on_every_kind(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    await checkpoint_mid_episode(http, tmp_path)
    new = await start_local_fleet(FAST)
    try:
        for kind in KIND_ORDER:
            reply = await new.engines[kind].handle(
                "restore", body("c1", checkpoint_dir=str(tmp_path), episode_ids=SCOPE)
            )
            assert reply["restored"] == ["r-a1"], kind
        for kind in reversed(KIND_ORDER):
            await new.engines[kind].handle("resume", body("c1"))

        # A late call of attempt 0 (sent before the crash) reaches the fresh
        # hosts: refused, never served from their empty state.
        for url, data in late_calls(new, "r", 0):
            status, reply = await post(http, url, data)
            assert (status, reply["error"]["code"]) == (409, "stale_attempt"), url
        assert new.server("environment").stats()["live_episodes"] == 0

        # Attempt 1 continues from the restored state.
        reply = await run_episode(http, new.urls["environment"], EpisodeId("r", 1), TASK)
        assert "result" in reply, reply

        # The marks last until forget, as retire marks do (yet retire nothing:
        # `retired_rollouts` counts the rollouts retire calls named).
        for engine in new.engines.values():
            assert engine.status()["retired_rollouts"] == 0
            assert await engine.handle("forget", body("f1", rollout_ids=["r"])) == {
                "forgotten": ["r"]
            }
            assert engine.status()["retired_rollouts"] == 0
    finally:
        await new.stop()
