"""Completion receipts across a crash: results whose replies the driver lost
are delivered after the restore, never run again.

A checkpoint is taken mid-flight; then several rollouts finish and the driver
loses their replies (as if each call failed after the Gym finished); the
driver acknowledges the results it did store, and a second checkpoint is
taken with only the rollouts it still awaits in its scope; every Gym actor is
killed (`ray.kill`) before that checkpoint resumes.  A fresh fleet restores
it; `collect()` returns exactly the lost results, with their receipts; the
driver stores and acknowledges them; only the rollouts still in flight
continue.  Nothing runs twice and the final results equal the uninterrupted
run's.
"""

from __future__ import annotations

from typing import Any

import pytest

from coordination.demo.scenario import crash, fleet_stats, restore_and_continue
from participants.rollout import result_digest
from ray_ckpt.control.client import data_session
from tests.e2e.conftest import E2E, assert_exactly_once, stats_until, until

pytestmark = [pytest.mark.ray]

N, STEPS, SEED, LOSE = 5, 3, 41, 2


def episodes_live(n: int) -> Any:
    return lambda s: s["environment"]["live_episodes"] >= n


async def test_results_lost_by_the_driver_are_collected_after_a_crash_not_rerun(
    e2e: E2E,
) -> None:
    config = e2e.config(completion_receipts=True, verify_delay_s=0.1)
    expected = await e2e.baseline(config, N, STEPS, SEED)
    gym = e2e.coordinator()
    fleet = await e2e.launch(config)
    rollouts, tally = e2e.rollouts(N, STEPS, SEED)
    c1, c2 = str(e2e.tmp / "c1"), str(e2e.tmp / "c2")
    async with data_session(64, 64) as session:
        for i, r in enumerate(rollouts.tasks):
            rollouts.start(session, fleet.urls["environment"], r, delay_s=0.3 * i)
        await stats_until(fleet, episodes_live(2), "two episodes in flight")
        first = await gym.acheckpoint(c1, rollouts.in_flight())
        assert first.continued

        # After the first checkpoint: the next LOSE results never reach the driver.
        rollouts.lose_next = LOSE
        await until(
            lambda: _done(len(rollouts.lost_replies) == LOSE), "two lost replies", timeout_s=30
        )
        lost = sorted(rollouts.lost_replies)
        stored = rollouts.take_receipts()
        if stored:
            await gym.aack(stored)  # the driver's own store committed these

        await gym.aprepare()
        scope = rollouts.in_flight()
        assert scope, "every rollout finished before the second checkpoint"
        assert not {e.rollout_id for e in scope} & set(lost)
        committed = await gym.acommit(c2, scope)
        env_key = fleet.names["environment"]
        assert not set(committed.episode_ids[env_key]) & set(lost)
        before = await fleet_stats(fleet)
        assert before["environment"]["unacknowledged_results"] == LOSE
        await crash(fleet, rollouts)
        await gym.aresume()

        fresh = await e2e.launch(config)
        cont = await restore_and_continue(gym, fresh, session, c2, scope, rollouts, collect=True)
        assert sorted(cont.recovered) == lost
        assert cont.continued
        assert not set(cont.continued) & set(lost)
        for r in lost:
            assert result_digest(rollouts.results[r]) == expected[r]
        await rollouts.wait(timeout_s=40)
        # Nothing ran twice: the fresh environment ran only the continued rollouts.
        after = await fleet_stats(fresh)
        assert after["environment"]["calls"]["run"] == len(cont.continued) + len(cont.restarted)
        await gym.aack(rollouts.take_receipts())
    assert_exactly_once(rollouts, tally, expected)
    assert (await gym.acollect()).results == []
    status = await fresh.hosts["environment"].status.remote()
    assert (status["unacknowledged_results"], status["unacknowledged_bytes"]) == (0, 0)


async def _done(value: bool) -> bool:
    return value
