"""The cases NeMo Gym's own end-to-end suite covers, on our fleet and coordinator.

Reference notes §3.1.  Crash cases run twice: in process (the real
coordination logic over the servers' own engines, real files) and on the
shared Ray cluster (`ParticipantHost` actors, `ray.kill`).  Every case asserts
that each rollout finished exactly once with the uninterrupted run's result,
and reports the work its crashes made the fleet redo.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from coordination.demo.scenario import Rollouts
from participants.fleet import FleetConfig
from ray_ckpt.control.client import data_session
from tests.e2e.conftest import E2E, Tally, assert_exactly_once, baseline
from tests.e2e.support_parity import (
    FAST,
    Gym,
    crash_restore,
    env_keys,
    expected_work,
    generating,
    publish,
    redone,
    start_gym,
    stats_until,
    summed,
    table,
    tool_in_flight,
    work,
)

Make = Callable[[FleetConfig], Awaitable[Gym]]
BACKENDS = ["local", pytest.param("ray", marks=[pytest.mark.ray, pytest.mark.slow])]


@pytest.fixture(params=BACKENDS)
def kit(request: pytest.FixtureRequest) -> E2E | None:
    """Part A's Ray kit for the Ray backend (resolved here, outside the event loop,
    because the kit is an async fixture); None in process."""
    kit: E2E | None = request.getfixturevalue("e2e") if request.param == "ray" else None
    return kit


@pytest.fixture
async def make_gym(kit: E2E | None) -> AsyncIterator[Make]:
    gyms: list[Gym] = []

    async def make(config: FleetConfig) -> Gym:
        gym = await start_gym(config, kit)
        gyms.append(gym)
        return gym

    yield make
    for gym in gyms:
        await gym.close()


def mid_flight(stats: dict[str, Any], *, live: int = 3) -> bool:
    """Every rollout begun, one generating and one in a tool call."""
    return (
        stats["environment"]["live_episodes"] == live
        and generating(stats, below=FAST.tokens_per_turn)
        and tool_in_flight(stats)
    )


def report_lost_work(
    request: pytest.FixtureRequest, gym: Gym, case: str, steps: list[int], end: dict[str, Any]
) -> dict[str, int]:
    lost = redone(summed([work(s) for s in [*gym.history, end]]), expected_work(gym.config, steps))
    text = table(
        f"lost work: {case} [{gym.backend}]",
        ["crashes", "episodes", "tokens redone", "turns redone", "tools redone", "verify redone"],
        [[len(gym.history), len(steps), *lost.values()]],
    )
    publish(request, f"lost_work_{case}", text)
    return lost


async def test_a_second_crash_before_the_replacement_starts_still_continues(
    make_gym: Make, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    rollouts = Rollouts.make(3, steps=2, seed=21)
    tally = Tally(rollouts)
    expected = await baseline(FAST, rollouts.tasks)
    gym = await make_gym(FAST)
    async with data_session(64, 64) as session:
        for i, rollout in enumerate(rollouts.tasks):
            rollouts.start(session, gym.env_url, rollout, delay_s=0.04 * i)
        await stats_until(gym, mid_flight, "a generation and a tool call in flight")
        await gym.prepare()
        scope = rollouts.unfinished()
        assert [e.attempt for e in scope] == [0, 0, 0]
        committed = await gym.commit(str(tmp_path / "c1"), scope)
        assert env_keys(committed) == ["r0", "r1", "r2"]

        restored = await crash_restore(gym, rollouts, str(tmp_path / "c1"), scope)
        replacements = [e.next() for e in scope]
        assert env_keys(restored) == ["r0-a1", "r1-a1", "r2-a1"]
        # Attempt 1 is named but its /run never starts: checkpoint it as it is.
        for e in replacements:
            rollouts.attempts[e.rollout_id] = e.attempt
        await gym.prepare()
        committed = await gym.commit(str(tmp_path / "c2"), replacements)
        assert env_keys(committed) == ["r0-a1", "r1-a1", "r2-a1"]

        restored = await crash_restore(gym, rollouts, str(tmp_path / "c2"), replacements)
        assert env_keys(restored) == ["r0-a2", "r1-a2", "r2-a2"]
        for e in replacements:
            rollouts.start(session, gym.env_url, e.rollout_id, attempt=e.attempt + 1)
        await rollouts.wait(timeout_s=60)
    assert_exactly_once(rollouts, tally, expected)
    assert tally.attempt == dict.fromkeys(expected, 2)
    end = await gym.stats()
    first, between = (work(s) for s in gym.history)
    # The fleet in between served nothing; the restored state passed through it.
    assert between == dict.fromkeys(between, 0), between
    # Tool calls wait for the checkpoint: across all three fleets each ran once.
    assert first["tools"] + work(end)["tools"] == expected_work(FAST, [2, 2, 2])["tools"]
    assert end["resources"]["calls"].get("seed_session", 0) == 0  # nothing started over
    lost = report_lost_work(request, gym, "second-crash", [2, 2, 2], end)
    # At most the one generation in flight per episode is regenerated.
    assert 0 <= lost["tokens"] <= 3 * FAST.tokens_per_turn


async def test_restoring_the_same_checkpoint_twice_leaves_the_dead_run_out_of_the_lineage(
    make_gym: Make, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    rollouts = Rollouts.make(3, steps=3, seed=22)
    tally = Tally(rollouts)
    expected = await baseline(FAST, rollouts.tasks)
    gym = await make_gym(FAST)
    c1 = tmp_path / "c1"
    async with data_session(64, 64) as session:
        for i, rollout in enumerate(rollouts.tasks):
            rollouts.start(session, gym.env_url, rollout, delay_s=0.04 * i)
        await stats_until(gym, mid_flight, "a generation and a tool call in flight")
        await gym.prepare()
        scope = rollouts.unfinished()
        assert env_keys(await gym.commit(str(c1), scope)) == ["r0", "r1", "r2"]

        await crash_restore(gym, rollouts, str(c1), scope)
        restored_rows = (await gym.stats())["model"]["ledger_entries"]
        for e in scope:
            rollouts.start(session, gym.env_url, e.rollout_id, attempt=1)
        # The replacement makes calls and tool moves of its own, then dies unsaved.
        progressed = await stats_until(
            gym,
            lambda s: (
                s["agent"]["tool_calls"] >= 3 and s["model"]["ledger_entries"] > restored_rows
            ),
            "the replacements to make progress",
        )
        assert not rollouts.results, "too slow a crash: a replacement already finished"
        await gym.crash(rollouts)

        # The same checkpoint again, into fresh hosts: attempt 1 once more.
        await gym.relaunch()
        again = await gym.restore(str(c1), scope)
        assert env_keys(again) == ["r0-a1", "r1-a1", "r2-a1"]
        fresh = await gym.stats()
        # Only what the checkpoint held: none of the dead replacement's calls.
        assert fresh["model"]["ledger_entries"] == restored_rows
        assert fresh["agent"]["tool_calls"] == 0
        for e in scope:
            rollouts.start(session, gym.env_url, e.rollout_id, attempt=1)
        await rollouts.wait(timeout_s=60)
    assert_exactly_once(rollouts, tally, expected)
    assert tally.attempt == dict.fromkeys(expected, 1)
    end = await gym.stats()
    first, dead = (work(s) for s in gym.history)
    assert dead["tools"] >= 3
    assert progressed["agent"]["tool_calls"] >= 3
    # The checkpointed tool moves are kept; the dead run's are redone exactly.
    assert first["tools"] + work(end)["tools"] == expected_work(FAST, [3, 3, 3])["tools"]
    assert end["resources"]["calls"].get("seed_session", 0) == 0
    lost = report_lost_work(request, gym, "same-checkpoint-twice", [3, 3, 3], end)
    assert lost["tools"] == dead["tools"]
