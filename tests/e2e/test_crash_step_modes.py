"""A verify in flight at the checkpoint, in each mode the resources server declares.

`wait`: the checkpoint waits for the verify, so the boundary after it is
exported and the verify never runs again.  `replay`: the boundary before it is
exported, so after the crash the verify runs once more.  Counted with the
resources server's `/stats` before the crash and on the fresh fleet after.

Also: two checkpoints in a row, then a restore of the older one.
"""

from __future__ import annotations

from typing import Any

import pytest

from coordination.demo.scenario import crash, fleet_stats, restore_and_continue
from ray_ckpt.control.client import data_session
from ray_ckpt.storage import read_gym_manifest, verify_checkpoint
from tests.e2e.conftest import E2E, assert_clean, assert_exactly_once, stats_until

pytestmark = [pytest.mark.ray]


def verifying(stats: dict[str, dict[str, Any]]) -> int:
    return int(stats["resources"]["inflight_by_route"].get("verify", 0))


@pytest.mark.parametrize("mode", ["wait", "replay"])
async def test_a_replayed_verify_runs_once_more_a_waited_one_does_not(e2e: E2E, mode: str) -> None:
    n, steps, seed = 3, 1, 44
    config = e2e.config(verify_mode=mode, verify_delay_s=0.6)
    expected = await e2e.baseline(config, n, steps, seed)
    gym = e2e.coordinator()
    fleet = await e2e.launch(config)
    rollouts, tally = e2e.rollouts(n, steps, seed)
    ckpt = str(e2e.tmp / "c1")
    async with data_session(256, 256) as session:
        for i, r in enumerate(rollouts.tasks):
            rollouts.start(session, fleet.urls["environment"], r, delay_s=0.2 * i)
        await stats_until(fleet, lambda s: verifying(s) >= 1, "a verify in flight")
        await gym.aprepare()
        scope = rollouts.unfinished()
        await gym.acommit(ckpt, scope)
        # A replayed verify still runs to its end on the old fleet (nothing waits
        # for it); let it, so the count of verifies run before the crash is exact.
        before = await stats_until(
            fleet, lambda s: verifying(s) == 0, "in-flight verifies to end", timeout_s=10
        )
        finished_before = len(rollouts.results)
        await crash(fleet, rollouts)
        await gym.aresume()

        fresh = await e2e.launch(config)
        cont = await restore_and_continue(
            gym, fresh, session, ckpt, rollouts.unfinished(), rollouts
        )
        await rollouts.wait(timeout_s=60)
        after = await fleet_stats(fresh)
    assert_exactly_once(rollouts, tally, expected)
    assert before["resources"]["verify_mode"] == mode

    old, new = before["resources"]["verifications"], after["resources"]["verifications"]
    # Verifies that ran on the old fleet for rollouts whose result never reached
    # the driver: the ones in flight when the checkpoint closed.
    in_flight = old - finished_before
    assert in_flight >= 1, (old, finished_before)
    assert len(cont.continued) == n - finished_before
    if mode == "wait":
        # Waited for: exported after the verify, continued without running it again.
        assert old + new == n, (old, new)
    else:
        # Replayed: each of them verified once more on the fresh fleet.
        assert old + new == n + in_flight, (old, new, in_flight)
    await assert_clean(fresh)


async def test_two_checkpoints_in_a_row_and_a_restore_of_the_older(e2e: E2E) -> None:
    n, steps, seed = 3, 2, 45
    config = e2e.config()
    expected = await e2e.baseline(config, n, steps, seed)
    gym = e2e.coordinator()
    fleet = await e2e.launch(config)
    rollouts, tally = e2e.rollouts(n, steps, seed)
    c1, c2 = str(e2e.tmp / "c1"), str(e2e.tmp / "c2")
    async with data_session(256, 256) as session:
        for i, r in enumerate(rollouts.tasks):
            rollouts.start(session, fleet.urls["environment"], r, delay_s=0.15 * i)
        first = await stats_until(
            fleet,
            lambda s: s["environment"]["live_episodes"] == n and s["model"]["generating"],
            "every rollout running, a generation in flight",
        )
        one = await gym.acheckpoint(c1, rollouts.unfinished())
        tokens = first["model"]["tokens_generated"]
        await stats_until(
            fleet,
            lambda s: s["model"]["tokens_generated"] >= tokens + 12,
            "progress after the first checkpoint",
        )
        two = await gym.acheckpoint(c2, rollouts.unfinished())
        assert one.checkpoint_id != two.checkpoint_id
        assert read_gym_manifest(c1).checkpoint_id == one.checkpoint_id
        assert read_gym_manifest(c2).checkpoint_id == two.checkpoint_id
        assert verify_checkpoint(c1).ok
        assert verify_checkpoint(c2).ok

        await crash(fleet, rollouts)
        fresh = await e2e.launch(config)
        scope = rollouts.unfinished()
        restored = await gym.arestore(c1, scope, resume=False)
        assert restored.source_checkpoint_id == one.checkpoint_id
        await gym.aresume()
        for episode in scope:
            rollouts.start(session, fresh.urls["environment"], episode.rollout_id, attempt=1)
        await rollouts.wait(timeout_s=60)
        after = await fleet_stats(fresh)
    assert_exactly_once(rollouts, tally, expected)
    keys = restored.restored[fresh.names["environment"]]
    assert sorted(keys) == sorted(e.next().capture_key for e in scope)
    assert after["environment"]["calls"]["run"] == len(scope)
    await assert_clean(fresh)
