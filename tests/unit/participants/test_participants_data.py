"""Data routes of the reference servers: retire frees everything, bad input is a
clear 4xx that changes nothing.  In-process fleet on loopback, real engines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from participants.fleet import FleetConfig
from participants.local import LocalFleet, start_local_fleet
from participants.rollout import make_tasks, run_episode
from ray_ckpt.errors import ParticipantUnavailable, RestartInScope
from ray_ckpt.identity import EpisodeId
from tests.unit.helpers import body, until

TASK = make_tasks(1, steps=2, seed=5)[0]


@pytest.fixture
async def fleet() -> AsyncIterator[LocalFleet]:
    fleet = await start_local_fleet(
        FleetConfig(step_delay_s=0.05, token_delay_s=0.01, tokens_per_turn=6)
    )
    yield fleet
    await fleet.stop()


async def post(
    http: aiohttp.ClientSession, url: str, data: Any, *, raw: bool = False
) -> tuple[int, Any]:
    kwargs: dict[str, Any] = {"data": data} if raw else {"json": data}
    async with http.post(url, **kwargs) as resp:
        return resp.status, await resp.json()


def held(fleet: LocalFleet) -> dict[str, int]:
    """Everything an attempt can hold, across the fleet."""
    env = fleet.server("environment").stats()
    model = fleet.server("model").stats()
    agent = fleet.server("agent").stats()
    resources = fleet.server("resources").stats()
    return {
        "episodes": env["live_episodes"] + env["restored_episodes"],
        "model_calls": model["live_calls"],
        "ledgers": model["ledgers"],
        "cuts": model["cuts"] + model["restored_cuts"],
        "agent_sessions": agent["sessions"],
        "activations": agent["live_activations"],
        "sessions": resources["sessions"] + resources["tracked_sessions"],
        "inflight": resources["inflight"],
    }


async def test_retire_stops_and_frees_everything_the_attempt_held(
    fleet: LocalFleet, http: aiohttp.ClientSession
) -> None:
    env_url = fleet.urls["environment"]
    run = asyncio.create_task(run_episode(http, env_url, EpisodeId("r"), TASK))
    model = fleet.server("model")
    # Mid-generation of the second model call: a ledger row, a live call, a
    # resources session, an agent session and a live episode all exist.
    await until(lambda: model.stats()["ledger_entries"] >= 1 and model.stats()["generating"])
    assert all(n > 0 for k, n in held(fleet).items() if k not in {"cuts", "inflight"})

    retire = body("ret-1", episode_ids=[{"rollout_id": "r", "attempt": 0}])
    for group in (("environment",), ("agent",), ("model", "resources")):
        replies = await asyncio.gather(
            *(fleet.engines[k].handle("retire", retire) for k in group)
        )
        assert all(r["retired"] == ["r"] for r in replies), replies
    with pytest.raises(ParticipantUnavailable):
        await asyncio.wait_for(run, 5)
    assert held(fleet) == dict.fromkeys(held(fleet), 0)

    # Late calls of the retired attempt are refused everywhere, and change nothing.
    calls = {k: dict(fleet.server(k).stats()["calls"]) for k in fleet.servers}
    late = [
        (env_url + "/run", {"episode_id": {"rollout_id": "r"}, "task": TASK}),
        (fleet.urls["model"] + "/ng-rollout/r/v1/responses", {"input": ["x"]}),
        (fleet.urls["agent"] + "/ng-rollout/r/activate", {"step": 0, "observation": "o"}),
        (fleet.urls["resources"] + "/ng-rollout/r/seed_session", {"task_id": "t", "seed": 1}),
        (fleet.urls["resources"] + "/ng-rollout/r/guess", {"value": 3}),
    ]
    for url, data in late:
        status, reply = await post(http, url, data)
        assert (status, reply["error"]["code"]) == (409, "stale_attempt"), url
    assert held(fleet) == dict.fromkeys(held(fleet), 0)
    assert model.stats()["tokens_generated"] == model.generated
    for kind, before in calls.items():
        after = fleet.server(kind).stats()["calls"]
        assert sum(after.values()) == sum(before.values()) + sum(
            1 for url, _ in late if url.startswith(fleet.urls[kind])
        )

    # The marks last until forget, then nothing about the rollout remains.
    for engine in fleet.engines.values():
        assert engine.status()["retired_rollouts"] == 1
        reply = await engine.handle("forget", body("fgt-1", rollout_ids=["r"]))
        assert reply == {"forgotten": ["r"]}
        assert engine.status()["retired_rollouts"] == 0


async def test_bad_input_is_a_clear_4xx_and_changes_nothing(
    fleet: LocalFleet, http: aiohttp.ClientSession
) -> None:
    env, model = fleet.urls["environment"], fleet.urls["model"]
    agent, res = fleet.urls["agent"], fleet.urls["resources"]
    # A real session to check that bad tool calls leave it untouched.
    status, _ = await post(http, f"{res}/ng-rollout/s1/seed_session", {"task_id": "t", "seed": 9})
    assert status == 200
    game = fleet.server("resources").game
    before = {k: dict(v) for k, v in game.states.items()}

    cases: list[tuple[str, Any, bool, int, str]] = [
        (f"{env}/run", b"{not json", True, 400, "invalid_request"),
        (f"{env}/run", {}, False, 400, "invalid_request"),
        (
            f"{env}/run",
            {"episode_id": {"rollout_id": "x"}, "task": {**TASK, "steps": 0}},
            False,
            400,
            "invalid_request",
        ),
        (
            f"{env}/run",
            {"episode_id": {"rollout_id": "x-a1"}, "task": TASK},
            False,
            400,
            "invalid_request",
        ),
        (f"{model}/ng-rollout/-bad/v1/responses", {"input": ["x"]}, False, 400, "invalid_request"),
        (f"{model}/ng-rollout/m/v1/responses", {"input": "hello"}, False, 400, "invalid_request"),
        (f"{model}/ng-rollout/m/v1/responses", [1, 2], False, 400, "invalid_request"),
        (
            f"{agent}/ng-rollout/a/activate",
            {"step": 2, "observation": "o"},
            False,
            404,
            "not_found",
        ),
        (f"{agent}/ng-rollout/a/activate", {"step": 0}, False, 400, "invalid_request"),
        (f"{res}/ng-rollout/nobody/guess", {"value": 1}, False, 404, "not_found"),
        (f"{res}/ng-rollout/nobody/verify", {}, False, 404, "not_found"),
        (f"{res}/ng-rollout/s1/guess", {"value": "seven"}, False, 400, "invalid_request"),
        (f"{res}/ng-rollout/s1/guess", {"value": 100}, False, 400, "invalid_request"),
        (f"{res}/ng-rollout/s2/seed_session", {"task_id": "t"}, False, 400, "invalid_request"),
    ]
    for url, data, raw, want_status, code in cases:
        status, reply = await post(http, url, data, raw=raw)
        assert (status, reply["error"]["code"]) == (want_status, code), (url, data, reply)
        assert reply["error"]["detail"]
    assert game.states == before
    assert held(fleet) == {**dict.fromkeys(held(fleet), 0), "sessions": 2}
    assert fleet.server("model").generated == 0


async def test_a_closed_model_refuses_new_calls_and_resources_hold_late_ones(
    fleet: LocalFleet, http: aiohttp.ClientSession
) -> None:
    res = fleet.urls["resources"]
    await post(http, f"{res}/ng-rollout/s1/seed_session", {"task_id": "t", "seed": 9})
    for kind in ("model", "resources"):
        reply = await fleet.engines[kind].handle("prepare", body("c1"))
        assert reply["phase"] == "prepared"
    status, reply = await post(
        http, f"{fleet.urls['model']}/ng-rollout/m/v1/responses", {"input": ["hi"]}
    )
    assert (status, reply["error"]["code"]) == (409, "admission_closed")
    # A late tool call is not refused: it waits for resume, then runs once.
    late = asyncio.create_task(post(http, f"{res}/ng-rollout/s1/guess", {"value": 4}))
    await asyncio.sleep(0.2)
    assert not late.done()
    assert fleet.server("resources").game.states[EpisodeId("s1")]["guesses"] == []
    for kind in ("resources", "model"):
        await fleet.engines[kind].handle("resume", body("c1"))
    status, reply = await asyncio.wait_for(late, 5)
    assert status == 200
    assert reply["state"]["guesses"] == [4]


async def test_restart_only_resources_make_the_episode_a_restart_that_never_blocks(
    http: aiohttp.ClientSession, tmp_path: Any
) -> None:
    fleet = await start_local_fleet(
        FleetConfig(resources_mode="restart_only", step_delay_s=0.05, token_delay_s=0.005)
    )
    try:
        env = fleet.engines["environment"]
        run = asyncio.create_task(
            run_episode(http, fleet.urls["environment"], EpisodeId("r"), TASK)
        )
        await until(lambda: env.participant.report(10).restarts == ["r"])
        for kind in ("environment", "model", "agent", "resources"):
            reply = await fleet.engines[kind].handle("prepare", body("c1"))
            assert reply["phase"] == "prepared", kind
        assert fleet.engines["resources"].participant.report(10).restarts == ["r"]
        scope = [{"rollout_id": "r", "attempt": 0}]
        commit = body("c1", checkpoint_dir=str(tmp_path), episode_ids=scope)
        with pytest.raises(RestartInScope):
            await env.handle("commit", commit)
        for kind in ("resources", "agent", "model", "environment"):
            await fleet.engines[kind].handle("resume", body("c1"))
        reply = await asyncio.wait_for(run, 10)
        assert reply["episode_id"] == {"rollout_id": "r", "attempt": 0}
        assert "result" in reply
    finally:
        await fleet.stop()


async def test_a_stateless_verifier_runs_episodes_and_holds_no_session(
    http: aiohttp.ClientSession,
) -> None:
    fleet = await start_local_fleet(FleetConfig(resources_mode="stateless", verify_mode="wait"))
    try:
        reply = await run_episode(http, fleet.urls["environment"], EpisodeId("r"), TASK)
        result = reply["result"]
        assert result["verification"]["hints"] == 0
        assert 0.0 <= result["reward"] <= 1.0
        stats = fleet.server("resources").stats()
        assert (stats["sessions"], stats["verify_mode"], stats["verifications"]) == (0, "replay", 1)
        assert await fleet.server("resources").participant.export(None) == []
    finally:
        await fleet.stop()
