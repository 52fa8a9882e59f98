"""The reference fleet in-process on loopback, driven through the real engines.

Each scenario runs an episode uninterrupted, runs the same task again, takes a
checkpoint with work in flight (mid-generation, mid-tool-call, mid-verify),
throws the fleet away, restores into a fresh fleet and continues as attempt 1:
every field of the result must equal the uninterrupted run's, and the stats
must show which work ran again and which did not.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from participants.fleet import KIND_ORDER, FleetConfig
from participants.local import LocalFleet, start_local_fleet
from participants.rollout import make_tasks, run_episode
from ray_ckpt.identity import EpisodeId
from tests.unit.helpers import body, until

Start = Callable[[FleetConfig], Awaitable[LocalFleet]]
TASK = make_tasks(1, steps=2, seed=3)[0]
FAST = FleetConfig(step_delay_s=0.05, token_delay_s=0.01, tokens_per_turn=6, turns_per_step=2)


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    fleets: list[LocalFleet] = []

    async def go(config: FleetConfig) -> LocalFleet:
        fleets.append(await start_local_fleet(config))
        return fleets[-1]

    yield go
    for fleet in fleets:
        await fleet.stop()


async def checkpoint(fleet: LocalFleet, cid: str, where: Path, scope: list[EpisodeId]) -> None:
    """Prepare in order, then commit everywhere (the engine's duty)."""
    for kind in KIND_ORDER:
        reply = await fleet.engines[kind].handle("prepare", body(cid))
        assert reply["phase"] == "prepared", (kind, reply)
    ids = [{"rollout_id": e.rollout_id, "attempt": e.attempt} for e in scope]
    for kind in KIND_ORDER:
        reply = await fleet.engines[kind].handle(
            "commit", body(cid, checkpoint_dir=str(where), episode_ids=ids)
        )
        assert reply["phase"] == "committed"


async def restore(fleet: LocalFleet, cid: str, where: Path, scope: list[EpisodeId]) -> None:
    ids = [{"rollout_id": e.rollout_id, "attempt": e.attempt} for e in scope]
    for kind in KIND_ORDER:
        reply = await fleet.engines[kind].handle(
            "restore", body(cid, checkpoint_dir=str(where), episode_ids=ids)
        )
        assert reply["restored"] == sorted(e.next().capture_key for e in scope), kind
    await resume(fleet, cid)


async def resume(fleet: LocalFleet, cid: str) -> None:
    for kind in reversed(KIND_ORDER):
        await fleet.engines[kind].handle("resume", body(cid))


async def baseline(fleet: LocalFleet, http: aiohttp.ClientSession) -> dict[str, Any]:
    reply = await run_episode(http, fleet.urls["environment"], EpisodeId("base"), TASK)
    assert "result" in reply, reply
    return dict(reply["result"])


async def crash_and_continue(
    start: Start,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    config: FleetConfig,
    in_flight: Callable[[LocalFleet], bool],
) -> tuple[dict[str, Any], LocalFleet, LocalFleet, dict[str, Any]]:
    """Baseline, then the same task checkpointed when `in_flight`, crashed, continued."""
    old = await start(config)
    expected = await baseline(old, http)
    stats_before = {k: old.server(k).stats() for k in KIND_ORDER}
    run = asyncio.create_task(run_episode(http, old.urls["environment"], EpisodeId("r"), TASK))
    await until(lambda: in_flight(old))
    await checkpoint(old, "c1", tmp_path, [EpisodeId("r")])
    run.cancel()
    await old.stop()  # the crash: nothing resumes, the fleet is gone
    new = await start(config)
    await restore(new, "c1", tmp_path, [EpisodeId("r")])
    reply = await run_episode(http, new.urls["environment"], EpisodeId("r", 1), TASK)
    assert reply["episode_id"] == {"rollout_id": "r", "attempt": 1}
    assert reply["result"] == expected
    return expected, old, new, stats_before


def generating(fleet: LocalFleet) -> bool:
    calls = fleet.server("model").participant.calls.values()
    return any(2 <= len(c.tokens) < 6 for c in calls)


async def test_mid_generation_prefix_is_cut_and_continued_after_a_crash(
    start: Start, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    _, old, new, _ = await crash_and_continue(start, http, tmp_path, FAST, generating)
    old_model = old.server("model")
    assert old_model.participant.counts["cut"] == 1
    model = new.server("model").stats()
    # The re-issued call continued the staged prefix instead of regenerating it.
    assert model["counts"]["calls_continued"] == 1
    assert model["tokens_continued"] >= 2
    # Attempt 1 generated only what attempt 0 had not: one conversation of
    # 4 turns x 6 tokens in all, minus the continued prefix.
    assert model["tokens_generated"] + model["tokens_continued"] == 4 * 6 - _delivered_tokens(old)


def _delivered_tokens(old: LocalFleet) -> int:
    rows = old.server("model").participant.ledger.get(EpisodeId("r"), [])
    return sum(int(row["tokens"]) for row in rows)


def tool_in_flight(fleet: LocalFleet) -> bool:
    routes = fleet.server("resources").participant.inflight_routes()
    return bool(routes.get("guess") or routes.get("hint"))


async def test_mid_tool_call_waits_and_no_tool_call_runs_twice(
    start: Start, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    _, old, new, before = await crash_and_continue(start, http, tmp_path, FAST, tool_in_flight)
    per_episode = before["agent"]["tool_calls"]
    assert per_episode == 4  # 2 steps x 2 tool rounds
    ran_before_crash = old.server("agent").tool_calls - per_episode
    assert ran_before_crash >= 1
    # The checkpoint waited for the tool call; the restored session went on
    # after it, so the two attempts together made each tool call once.
    assert ran_before_crash + new.server("agent").tool_calls == per_episode
    assert new.server("resources").stats()["calls"].get("seed_session", 0) == 0


@pytest.mark.parametrize("verify_mode", ["wait", "replay"])
async def test_mid_verify_is_waited_for_or_replayed(
    start: Start, http: aiohttp.ClientSession, tmp_path: Path, verify_mode: str
) -> None:
    config = FleetConfig(
        step_delay_s=0.01,
        verify_delay_s=0.3,
        token_delay_s=0.0,
        tokens_per_turn=4,
        turns_per_step=1,
        verify_mode=verify_mode,
    )

    def verifying(fleet: LocalFleet) -> bool:
        return bool(fleet.server("resources").participant.inflight_routes().get("verify"))

    _, old, new, _ = await crash_and_continue(start, http, tmp_path, config, verifying)
    new_env = new.server("environment").stats()
    assert new_env.get("agent_steps", 0) == 0  # every step was done before the crash
    if verify_mode == "wait":
        # The checkpoint waited: the boundary after verify was exported.
        assert old.server("resources").verifications == 2
        assert new.server("resources").verifications == 0
    else:
        # Replay: exported before verify, which runs again on restored state.
        assert new.server("resources").verifications == 1


async def test_a_held_response_is_delivered_after_resume_without_a_crash(
    start: Start, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    fleet = await start(FAST)
    expected = await baseline(fleet, http)
    run = asyncio.create_task(run_episode(http, fleet.urls["environment"], EpisodeId("r"), TASK))
    await until(lambda: generating(fleet))
    model = fleet.server("model")
    delivered = model.stats()["ledger_entries"]
    await checkpoint(fleet, "c1", tmp_path, [EpisodeId("r")])
    # The generation finishes while closed, but its response is held.
    await until(lambda: _held(fleet))
    await asyncio.sleep(0.05)
    assert model.stats()["ledger_entries"] == delivered
    assert not run.done()
    await resume(fleet, "c1")
    reply = await asyncio.wait_for(run, 10)
    assert reply["result"] == expected
    assert model.participant.counts["cut"] == 1
    assert model.stats()["counts"].get("calls_continued", 0) == 0


def _held(fleet: LocalFleet) -> bool:
    calls = fleet.server("model").participant.calls.values()
    return any(len(c.tokens) == 6 and not c.delivering for c in calls)
