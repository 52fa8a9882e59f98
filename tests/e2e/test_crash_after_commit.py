"""Crash after commit, before resume: every Gym host dies with a committed checkpoint open.

Two kinds of death: `ray.kill` of every host, and a real `kill -9` of each
host's worker process (its pid from the host's `ready()`).  A fresh fleet under
the same names restores the checkpoint through a coordinator and continues
every unfinished rollout as attempt 1; the results equal the uninterrupted
run's and every rollout finishes exactly once.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil
import pytest
import ray

from coordination.demo.scenario import crash, fleet_stats, restore_and_continue
from participants.fleet import Fleet
from ray_ckpt.control.client import data_session
from ray_ckpt.storage import verify_checkpoint
from tests.e2e.conftest import E2E, assert_clean, assert_exactly_once, stats_until, until

pytestmark = [pytest.mark.ray]

N, STEPS, SEED = 3, 2, 21


def mid_flight(stats: dict[str, dict[str, Any]]) -> bool:
    """A generation early enough that the checkpoint surely cuts it (at most 3
    of its 8 tokens: 150 ms of generation left), and more than one rollout live."""
    early = any(t <= 3 for t in stats["model"]["in_flight_tokens"])
    return early and stats["environment"]["live_episodes"] >= 2


async def sigkill(fleet: Fleet) -> None:
    """`kill -9` every host's process (found through Ray) and see each one gone."""
    pids = {kind: int(info["pid"]) for kind, info in fleet.info.items()}
    assert len(set(pids.values())) == len(pids), f"one process per host: {pids}"
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)

    def alive(pid: int) -> bool:
        # The process may vanish between any two of these calls: gone, then.
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    async def gone() -> bool:
        return not any(alive(p) for p in pids.values())

    await until(gone, f"host processes {pids} to be gone", timeout_s=10)
    for host in fleet.hosts.values():
        with pytest.raises(ray.exceptions.RayActorError):
            await host.ready.remote()
    # Ray marks a killed actor dead at once, but keeps its name while its owner
    # (this driver) holds a handle: release the dead handles so the same names
    # can be launched again (a crashed driver would have dropped them).
    fleet.kill()


@pytest.mark.parametrize("how", ["ray_kill", "sigkill"])
async def test_crash_after_commit_restores_and_continues(e2e: E2E, how: str) -> None:
    config = e2e.config(token_delay_s=0.03, tokens_per_turn=8)
    expected = await e2e.baseline(config, N, STEPS, SEED)
    gym = e2e.coordinator()
    fleet = await e2e.launch(config)
    rollouts, tally = e2e.rollouts(N, STEPS, SEED)
    ckpt = str(e2e.tmp / "c1")
    async with data_session(256, 256) as session:
        for i, r in enumerate(rollouts.tasks):
            rollouts.start(session, fleet.urls["environment"], r, delay_s=0.15 * i)
        await stats_until(fleet, mid_flight, "an early generation in flight")

        await gym.aprepare()
        scope = rollouts.unfinished()
        committed = await gym.acommit(ckpt, scope)
        assert verify_checkpoint(ckpt).ok
        before = await fleet_stats(fleet)
        assert before["model"]["counts"].get("cut", 0) >= 1, "a generation was cut"

        started = time.monotonic()
        if how == "sigkill":
            await sigkill(fleet)
            await rollouts.abandon()
        else:
            await crash(fleet, rollouts)
        resumed = await gym.aresume()
        # The dead hosts cannot answer: reported, not raised.
        assert resumed.checkpoint_id == committed.checkpoint_id
        assert set(resumed.failures) == set(fleet.names.values())

        fresh = await e2e.launch(config)
        assert fresh.names == fleet.names
        cont = await restore_and_continue(gym, fresh, session, ckpt, scope, rollouts)
        assert cont.continued, "at least one rollout continued from its restored boundary"
        assert sorted(cont.continued + cont.restarted) == sorted(e.rollout_id for e in scope)
        await rollouts.wait(timeout_s=60)
        recovered_s = time.monotonic() - started

    assert_exactly_once(rollouts, tally, expected)
    for rollout in cont.continued + cont.restarted:
        assert tally.attempt[rollout] == 1
    after = await fleet_stats(fresh)
    # Cut work continued on the new fleet instead of being generated again.
    assert after["model"]["counts"].get("calls_continued", 0) >= 1
    assert after["environment"].get("failures", 0) == 0
    await assert_clean(fresh)
    assert recovered_s < 60
