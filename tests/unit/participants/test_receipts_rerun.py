"""A rollout whose finished result is held for acknowledgement is not run
again: `/run` of any attempt of it is refused (409 `result_held`) before
anything runs, until the result is acknowledged or the rollout retired.
Over the reference fleet in-process, on real loopback HTTP."""

from __future__ import annotations

from typing import Any

import aiohttp

from participants.fleet import FleetConfig
from participants.local import start_local_fleet
from participants.rollout import make_tasks


def run_body(rollout: str, attempt: int) -> dict[str, Any]:
    return {
        "episode_id": {"rollout_id": rollout, "attempt": attempt},
        "task": make_tasks(1, 1, seed=11)[0],
    }


async def test_a_held_result_is_not_run_twice() -> None:
    config = FleetConfig(token="rerun-token", completion_receipts=True, step_delay_s=0.0)
    fleet = await start_local_fleet(config)
    env = fleet.server("environment")
    engine = fleet.engines["environment"]
    try:
        async with aiohttp.ClientSession() as http:
            run = f"{fleet.urls['environment']}/run"
            async with http.post(run, json=run_body("r1", 0)) as resp:
                first = await resp.json()
            receipt = first["receipt"]
            seeds = env.counters["seeds"]
            for attempt in (0, 1):  # the same attempt again, or a "retry" as attempt + 1
                async with http.post(run, json=run_body("r1", attempt)) as resp:
                    assert resp.status == 409
                    error = (await resp.json())["error"]
                assert error["code"] == "result_held"
                assert "collect" in error["detail"]
            assert env.counters["seeds"] == seeds, "nothing ran"
            assert len(env.participant.receipts) == 1
            # Another rollout runs; once acknowledged, r1 may run again (the
            # trainer's choice: its result was handed over).
            async with http.post(run, json=run_body("r2", 0)) as resp:
                assert "result" in await resp.json()
            await engine.handle("ack", {"receipts": [receipt]})
            async with http.post(run, json=run_body("r1", 1)) as resp:
                assert resp.status == 200
                assert "result" in await resp.json()
    finally:
        await fleet.stop()
