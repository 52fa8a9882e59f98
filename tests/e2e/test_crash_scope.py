"""What the engine leaves out: an unscoped restored episode, a retired straggler.

- After a restore, a commit whose scope omits a restored episode nobody
  claimed frees its state on every server; the rollout then starts over.
- A prepare that misses its deadline behind a straggler aborts (everyone
  resumes); the straggler is retired, restarted as its next attempt, and the
  next checkpoint succeeds without it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from coordination.demo.scenario import Rollouts, crash, fleet_stats
from ray_ckpt.control.client import data_session
from ray_ckpt.errors import CoordinationFailed
from ray_ckpt.identity import EpisodeId
from tests.e2e.conftest import (
    E2E,
    assert_clean,
    assert_exactly_once,
    host_phases,
    stats_until,
    until,
)

pytestmark = [pytest.mark.ray]


def state_held(stats: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Per-episode state that a restore installs, by server."""
    return {
        "env_restored": stats["environment"]["restored_episodes"],
        "agent_sessions": stats["agent"]["sessions"],
        "resources_sessions": stats["resources"]["sessions"],
        "model_ledgers": stats["model"]["ledgers"],
    }


async def test_a_restored_episode_left_out_of_the_next_scope_is_freed(e2e: E2E) -> None:
    n, steps, seed = 3, 2, 55
    config = e2e.config()
    expected = await e2e.baseline(config, n, steps, seed)
    gym = e2e.coordinator()
    fleet = await e2e.launch(config)
    rollouts, tally = e2e.rollouts(n, steps, seed)
    async with data_session(256, 256) as session:
        for i, r in enumerate(rollouts.tasks):
            rollouts.start(session, fleet.urls["environment"], r, delay_s=0.1 * i)
        # Every rollout holds state on every server (an agent and a game session).
        await stats_until(
            fleet,
            lambda s: s["agent"]["sessions"] == n and s["resources"]["sessions"] == n,
            "every rollout with agent and resources sessions",
        )
        await gym.aprepare()
        scope = rollouts.unfinished()
        assert len(scope) == n
        await gym.acommit(str(e2e.tmp / "c1"), scope)
        await crash(fleet, rollouts)
        await gym.aresume()

        fresh = await e2e.launch(config)
        restored = await gym.arestore(str(e2e.tmp / "c1"), scope)
        kept, dropped = EpisodeId("r1", 1), EpisodeId("r2", 1)
        assert restored.restored[fresh.names["environment"]] == ["r0-a1", "r1-a1", "r2-a1"]
        rollouts.start(session, fresh.urls["environment"], "r0", attempt=1)
        await until(_done(rollouts, "r0"), "r0 to finish as attempt 1")
        both = state_held(await fleet_stats(fresh))
        assert both["env_restored"] == 2
        assert both["agent_sessions"] == 2
        assert both["resources_sessions"] == 2

        two = await gym.acheckpoint(str(e2e.tmp / "c2"), [kept])
        assert two.episode_ids[fresh.names["environment"]] == [kept.capture_key]
        assert all(dropped.capture_key not in keys for keys in two.episode_ids.values())
        one = state_held(await fleet_stats(fresh))
        # The unscoped episode's state is gone everywhere; the scoped one's stays.
        assert one == {k: v - 1 for k, v in both.items()}, (both, one)

        rollouts.start(session, fresh.urls["environment"], "r1", attempt=1)
        # Nothing of r2-a1 is left to continue: it starts over from its task.
        rollouts.start(session, fresh.urls["environment"], "r2", attempt=1)
        await rollouts.wait(timeout_s=60)
        after = await fleet_stats(fresh)
    assert_exactly_once(rollouts, tally, expected)
    assert after["environment"]["seeds"] == 1, "only the freed rollout seeded again"
    await assert_clean(fresh)


def _done(rollouts: Rollouts, rollout: str) -> Callable[[], Awaitable[bool]]:
    """A probe: the rollout's current attempt replied (a result or a failure)."""

    async def probe() -> bool:
        return rollout in rollouts.results or rollout in rollouts.failures

    return probe


async def test_a_straggler_is_retired_after_resume_and_the_next_checkpoint_succeeds(
    e2e: E2E,
) -> None:
    n, steps, seed = 3, 1, 66
    # A long wait-mode verify: the episode running it is the straggler.
    config = e2e.config(verify_delay_s=2.0)
    expected = await e2e.baseline(config, n, steps, seed)
    gym = e2e.coordinator()
    fleet = await e2e.launch(config)
    rollouts, tally = e2e.rollouts(n, steps, seed)
    async with data_session(256, 256) as session:
        for i, r in enumerate(rollouts.tasks):
            rollouts.start(session, fleet.urls["environment"], r, delay_s=0.3 * i)
        await stats_until(
            fleet,
            lambda s: s["resources"]["inflight_by_route"].get("verify", 0) == 1,
            "one verify in flight",
        )
        with pytest.raises(CoordinationFailed) as info:
            await gym.aprepare(deadline_s=0.3)
        why = info.value.failures[fleet.names["environment"]]
        assert why["code"] == "deadline_exceeded", why
        keys = why["blockers"]
        assert keys, why
        # Aborted: everyone resumed, admission is open again.
        assert set((await host_phases(fleet)).values()) == {"idle"}

        stragglers = [EpisodeId.from_capture_key(k) for k in keys]
        for straggler in stragglers:
            assert rollouts.episode(straggler.rollout_id) == straggler
            retired = await gym.aretire(straggler.rollout_id, straggler.attempt)
            key = straggler.capture_key
            assert retired.retired[fleet.names["environment"]] == [key]
            assert retired.retired[fleet.names["resources"]] == [key]
            await until(_done(rollouts, straggler.rollout_id), "the retired attempt's /run to end")
            assert straggler.rollout_id not in rollouts.results
            # The engine starts the rollout over as its next attempt.
            rollouts.start(session, fleet.urls["environment"], straggler.rollout_id, attempt=1)

        scope = rollouts.unfinished()
        again = await gym.acheckpoint(str(e2e.tmp / "c2"), scope)
        assert not set(keys) & set(again.episode_ids[fleet.names["environment"]])
        await rollouts.wait(timeout_s=60)
        status = await fleet.hosts["environment"].status.remote()
    assert_exactly_once(rollouts, tally, expected)
    assert all(tally.attempt[s.rollout_id] == 1 for s in stragglers)
    assert status["retired_rollouts"] == len(stragglers)
    await assert_clean(fleet)
