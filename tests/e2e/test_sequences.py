"""Randomized control sequences against the reference fleet (reference notes §3.2).

Each seed drives rollouts of mixed lengths through a random mix of: start a
rollout, let work progress, checkpoint (then resume, or half the time crash
every server and restore into fresh ones), and retire a running attempt and
dispatch the next one.  Restored replacements start after a random delay, so
some checkpoints name a replacement that has not begun yet.  Whatever
happened, every rollout ends with exactly one result, equal to the
uninterrupted run's; the only failures are the attempts the engine
retired; every committed checkpoint verifies; and after the engine frees
and forgets everything, every server is idle and holds nothing.

Most seeds run in process (the real coordination logic over the servers' own
engines); one runs on Ray hosts.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from coordination.demo.scenario import Rollouts
from participants.rollout import make_tasks
from ray_ckpt.control.client import data_session
from ray_ckpt.storage import verify_checkpoint
from tests.e2e.conftest import E2E, baseline
from tests.e2e.support_parity import (
    FAST,
    Gym,
    assert_idle_and_empty,
    crash_restore,
    env_keys,
    expected_work,
    publish,
    redone,
    replace,
    start_gym,
    summed,
    table,
    work,
)

CASES = [
    pytest.param("local", 1, 24, id="local-1"),
    pytest.param("local", 2, 24, id="local-2"),
    pytest.param("local", 3, 24, id="local-3"),
    pytest.param("local", 5, 24, id="local-5"),
    pytest.param("ray", 4, 12, id="ray-4", marks=[pytest.mark.ray, pytest.mark.slow]),
]
N_ROLLOUTS = 5


class Sequence:
    """The engine: the random actions and the duties that come with them."""

    def __init__(self, gym: Gym, rollouts: Rollouts, rng: random.Random, where: Path) -> None:
        self.gym = gym
        self.rollouts = rollouts
        self.rng = rng
        self.where = where
        self.started: set[str] = set()
        self.retired: set[tuple[str, int]] = set()
        self.failed: list[tuple[str, int]] = []
        self.finished: Counter[str] = Counter()
        self.checkpoints: list[Path] = []
        self.actions: Counter[str] = Counter()
        rollouts.on_event = self.on_event

    def on_event(self, event: str, rollout: str) -> None:
        if event == "failed":
            self.failed.append((rollout, self.rollouts.attempts[rollout]))
        elif event == "finished":
            self.finished[rollout] += 1

    def pending(self) -> list[str]:
        return [r for r in self.rollouts.tasks if r not in self.started]

    def in_flight(self) -> list[str]:
        return sorted(r for r in self.started if r not in self.rollouts.results)

    def start(self, session: aiohttp.ClientSession, rollout: str, attempt: int = 0) -> None:
        self.started.add(rollout)
        # Sometimes late, so a checkpoint can name an attempt that has not begun.
        delay = self.rng.choice([0.0, 0.0, self.rng.uniform(0.05, 0.3)])
        self.rollouts.start(session, self.gym.env_url, rollout, attempt=attempt, delay_s=delay)

    async def step(self, session: aiohttp.ClientSession) -> None:
        choices = ["progress"] * 3 + ["checkpoint"] * 2
        if self.pending():
            choices += ["start"] * 3
        if self.in_flight():
            choices += ["retire"] * 2
        action = self.rng.choice(choices)
        if action == "start":
            self.start(session, self.rng.choice(self.pending()))
        elif action == "progress":
            await asyncio.sleep(self.rng.uniform(0.02, 0.15))
        elif action == "checkpoint":
            await self.checkpoint(session, crash=self.rng.random() < 0.5)
        else:
            await self.retire(session, self.rng.choice(self.in_flight()))

    async def checkpoint(self, session: aiohttp.ClientSession, *, crash: bool) -> None:
        self.actions["crash" if crash else "checkpoint"] += 1
        await self.gym.prepare()
        # In flight = named by the attempt the engine continues (which may
        # be a restored replacement that has not begun yet).
        scope = [self.rollouts.episode(r) for r in self.in_flight()]
        where = self.where / f"c{len(self.checkpoints)}"
        await self.gym.commit(str(where), scope)
        self.checkpoints.append(where)
        if not crash:
            await self.gym.resume()
            return
        restored = await crash_restore(self.gym, self.rollouts, str(where), scope)
        continued = set(env_keys(restored))
        for episode in scope:
            if episode.rollout_id in self.rollouts.results:
                continue  # its reply beat the checkpoint to the driver
            nxt = episode.next()
            self.actions["continued" if nxt.capture_key in continued else "restarted"] += 1
            self.start(session, episode.rollout_id, nxt.attempt)

    async def retire(self, session: aiohttp.ClientSession, rollout: str) -> None:
        self.actions["retire"] += 1
        episode = self.rollouts.episode(rollout)
        await self.gym.retire([episode])
        driver = self.rollouts.running.get(rollout)
        if driver is not None:
            # A delayed start still sends its /run (and is refused as stale).
            await asyncio.wait_for(asyncio.shield(driver), 10)
        if rollout in self.rollouts.results:
            return  # it finished before the retire reached it: the result stands
        self.retired.add((rollout, episode.attempt))
        self.start(session, rollout, episode.attempt + 1)

    async def finish(self, session: aiohttp.ClientSession) -> None:
        if not self.actions["crash"]:
            await self.checkpoint(session, crash=True)  # every seed crashes at least once
        for rollout in self.pending():
            self.start(session, rollout)
        await self.rollouts.wait(timeout_s=90)


@pytest.fixture
def kit(request: pytest.FixtureRequest) -> E2E | None:
    """Part A's Ray kit for the Ray seeds (resolved outside the event loop: the
    kit is an async fixture); None in process."""
    ray = request.node.callspec.params.get("backend") == "ray"
    kit: E2E | None = request.getfixturevalue("e2e") if ray else None
    return kit


@pytest.fixture
async def gyms() -> AsyncIterator[list[Gym]]:
    started: list[Gym] = []
    yield started
    for gym in started:
        await gym.close()


def mixed_tasks(seed: int) -> dict[str, dict[str, Any]]:
    rng = random.Random(seed)
    return {
        f"s{seed}r{i}": make_tasks(1, steps=rng.randint(1, 3), seed=seed * 100 + i)[0]
        for i in range(N_ROLLOUTS)
    }


@pytest.mark.parametrize(("backend", "seed", "n_steps"), CASES)
async def test_random_sequences_end_with_every_result_and_every_server_empty(
    backend: str,
    seed: int,
    n_steps: int,
    kit: E2E | None,
    gyms: list[Gym],  # after the kit: our gyms close before it kills what is left
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    rng = random.Random(seed)
    config = replace(FAST, verify_mode="replay" if seed % 2 else "wait")
    rollouts = Rollouts(mixed_tasks(seed))
    expected = await baseline(config, rollouts.tasks)
    gym = await start_gym(config, kit)
    gyms.append(gym)
    run = Sequence(gym, rollouts, rng, tmp_path)
    async with data_session(64, 64) as session:
        try:
            for _ in range(n_steps):
                await run.step(session)
            await run.finish(session)
        finally:
            await rollouts.abandon()  # nothing outlives the session on failure

    assert sorted(rollouts.results) == sorted(expected), rollouts.failures
    assert rollouts.digests() == expected
    assert dict(run.finished) == dict.fromkeys(expected, 1)
    # Failures come only from the engine's own retires.
    assert set(run.failed) <= run.retired, (run.failed, run.retired)
    for where in run.checkpoints:
        report = verify_checkpoint(where)
        assert report.ok, (where, report.errors)

    lost = redone(
        summed([work(s) for s in [*gym.history, await gym.stats()]]),
        expected_work(config, [int(t["steps"]) for t in rollouts.tasks.values()]),
    )
    publish(
        request,
        f"sequence_{backend}_{seed}",
        table(
            f"random sequence: seed {seed} [{backend}], verify {config.verify_mode}",
            ["actions", "retired", "tokens redone", "turns redone", "tools redone"],
            [[dict(sorted(run.actions.items())), len(run.retired), *list(lost.values())[:3]]],
        ),
    )

    # The engine frees the finished attempts and forgets every rollout.
    final = [rollouts.episode(r) for r in sorted(rollouts.tasks)]
    await gym.retire(final)
    await assert_idle_and_empty(gym, retired_rollouts=N_ROLLOUTS)
    await gym.forget(sorted(rollouts.tasks))
    await assert_idle_and_empty(gym, retired_rollouts=0)
