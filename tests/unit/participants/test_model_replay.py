"""The model's ledger and the agent's boundary agree on every call after a restore.

The window: prepare goes environment → model → agent.  The model counts a
call as delivered (and records its row) when the response has been written,
but if the agent's replay step around that call has not exited when the agent
closes, the agent exports its boundary *before* the call.  After a restore the
agent re-issues the call; the model must replace the dropped delivery's row,
not add a second one.  The window is held open with a delay injected in the
agent right after the model call returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from participants.fleet import KIND_ORDER, FleetConfig
from participants.local import LocalFleet, start_local_fleet
from participants.rollout import make_tasks, run_episode
from ray_ckpt.identity import EpisodeId
from tests.unit.helpers import body

CONFIG = FleetConfig(tokens_per_turn=4, turns_per_step=1)
TASK = make_tasks(1, steps=2, seed=11)[0]  # two model calls per episode
R = EpisodeId("r")
IDS = [{"rollout_id": "r", "attempt": 0}]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def collecting(fleet: LocalFleet) -> dict[str, list[dict[str, Any]]]:
    collected: dict[str, list[dict[str, Any]]] = {}
    model = fleet.server("model").participant
    model.collect = lambda episode, rows: collected.__setitem__(episode.capture_key, rows)
    return collected


def lineage(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    # The admission index `call` is per process; the rest is the call itself.
    return [(r["position"], r["digest"], r["tokens"]) for r in rows]


async def test_a_response_the_agent_dropped_is_replaced_not_repeated_after_restore(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    old = await start_local_fleet(CONFIG)
    try:
        collected = collecting(old)
        base = await run_episode(http, old.urls["environment"], EpisodeId("base"), TASK)
        assert len(collected["base"]) == 2
        expected_rows = lineage(collected["base"])

        reached, release = asyncio.Event(), asyncio.Event()
        seen: dict[EpisodeId, int] = {}

        async def after_model(episode: EpisodeId, reply: dict[str, Any]) -> None:
            seen[episode] = seen.get(episode, 0) + 1
            if episode == R and seen[episode] == 2:
                reached.set()
                await release.wait()  # the agent's replay step has not exited yet

        old.server("agent").after_model = after_model
        run = asyncio.create_task(run_episode(http, old.urls["environment"], R, TASK))
        await asyncio.wait_for(reached.wait(), 10)
        for kind in KIND_ORDER:
            reply = await old.engines[kind].handle("prepare", body("c1"))
            assert reply["phase"] == "prepared", (kind, reply)
        # The model delivered the second call; the agent is still before it.
        assert len(old.server("model").participant.ledger[R]) == 2
        where = str(tmp_path / "c1")
        for kind in KIND_ORDER:
            await old.engines[kind].handle(
                "commit", body("c1", checkpoint_dir=where, episode_ids=IDS)
            )
        run.cancel()
    finally:
        await old.stop()  # the crash: the delayed reply dies with the agent

    new = await start_local_fleet(CONFIG)
    try:
        collected = collecting(new)
        for kind in KIND_ORDER:
            await new.engines[kind].handle(
                "restore", body("c1", checkpoint_dir=where, episode_ids=IDS)
            )
        for kind in reversed(KIND_ORDER):
            await new.engines[kind].handle("resume", body("c1"))
        reply = await run_episode(http, new.urls["environment"], R.next(), TASK)
        assert reply["result"] == base["result"]
        assert new.server("agent").model_calls == 1  # the dropped call, re-issued
        # Attempt 1's ledger is the uninterrupted run's: 2 rows, not 3.
        assert lineage(collected["r-a1"]) == expected_rows
    finally:
        await new.stop()


@pytest.mark.parametrize("position", ["-1", "one", "²", "99999999999"])
async def test_a_malformed_call_position_is_a_400_and_admits_nothing(
    http: aiohttp.ClientSession, position: str
) -> None:
    fleet = await start_local_fleet(CONFIG)
    try:
        request = {"input": [{"role": "user", "content": "x"}]}
        async with http.post(
            fleet.urls["model"] + "/ng-rollout/r/v1/responses",
            json=request,
            headers={"x-ng-model-call": position},
        ) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "invalid_request"
        model = fleet.server("model")
        assert model.generated == 0
        assert model.participant.fresh()
    finally:
        await fleet.stop()
