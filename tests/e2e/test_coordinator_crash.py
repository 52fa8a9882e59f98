"""The coordinator dies with every participant prepared.

Nobody resumes them, so each participant's lease lapses and it resumes by
itself; the rollouts carry on.  A new coordinator under the same name, over the
same journal, recovers (aborting the dead one's checkpoint, idempotently) and
checkpoints again with a fresh ID; a delayed request of the dead one, sent
straight to a host, is refused by fencing.  Every rollout still finishes
exactly once with the uninterrupted result.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import ray

from coordination.client.handle import CoordinatorHandle
from coordination.demo.scenario import fleet_stats
from participants.fleet import Fleet
from ray_ckpt.control.client import ControlClient, data_session
from ray_ckpt.errors import CheckpointError, StaleCheckpoint
from ray_ckpt.storage import verify_checkpoint
from tests.e2e.conftest import (
    E2E,
    assert_clean,
    assert_exactly_once,
    host_phases,
    stats_until,
    until,
)

pytestmark = [pytest.mark.ray]

LEASE_S = 1.0
# A lease runs to the request's deadline plus the grace: keep both short.
PREPARE_S = 1.5


def mid_flight(stats: dict[str, dict[str, Any]]) -> bool:
    return stats["environment"]["live_episodes"] >= 2 and bool(stats["model"]["generating"])


async def phases(fleet: Fleet) -> set[str]:
    return set((await host_phases(fleet)).values())


async def test_coordinator_killed_mid_checkpoint_leases_lapse_and_a_new_one_takes_over(
    e2e: E2E,
) -> None:
    n, steps, seed = 3, 2, 77
    config = e2e.config(lease_grace_seconds=LEASE_S)
    expected = await e2e.baseline(config, n, steps, seed)
    gym = e2e.coordinator(name="e2e-coordinator")
    fleet = await e2e.launch(config)
    rollouts, tally = e2e.rollouts(n, steps, seed)
    async with data_session(256, 256) as session:
        for i, r in enumerate(rollouts.tasks):
            rollouts.start(session, fleet.urls["environment"], r, delay_s=0.1 * i)
        await stats_until(fleet, mid_flight, "rollouts mid-generation")
        prepared = await gym.aprepare(deadline_s=PREPARE_S)
        assert await phases(fleet) == {"prepared"}
        tokens = (await fleet_stats(fleet))["model"]["tokens_generated"]

        ray.kill(gym.actor, no_restart=True)
        killed = time.monotonic()

        async def all_idle() -> bool:
            return await phases(fleet) == {"idle"}

        # Each lease lapses and its participant resumes by itself.
        await until(all_idle, "every participant to resume on its own", timeout_s=15)
        lapsed_s = time.monotonic() - killed
        assert lapsed_s < PREPARE_S + LEASE_S + 5, lapsed_s
        await stats_until(
            fleet,
            lambda s: s["model"]["tokens_generated"] > tokens,
            "rollouts to carry on after the lapse",
        )

        # Same name, same journal: it recovers the open checkpoint, then serves.
        async def successor() -> CoordinatorHandle | None:
            handle = e2e.coordinator(name="e2e-coordinator")
            try:
                recovered = await handle.actor.ping.remote()
            except Exception:
                return None  # the dead one's name was not released yet
            assert recovered == prepared.checkpoint_id
            return handle

        new = await until(successor, "a new coordinator under the same name", timeout_s=30)
        assert new is not None
        again = await new.acheckpoint(str(e2e.tmp / "c2"), rollouts.unfinished())
        assert again.checkpoint_id != prepared.checkpoint_id
        assert verify_checkpoint(str(e2e.tmp / "c2")).ok

        # The dead coordinator's delayed commit reaches the hosts now: refused.
        late = {
            "checkpoint_id": prepared.checkpoint_id,
            "deadline_ts": time.time() + 5,
            "checkpoint_dir": str(e2e.tmp / "late"),
            "episode_ids": None,
        }
        for kind, host in fleet.ordered():
            with pytest.raises(ray.exceptions.RayTaskError) as info:
                await host.commit.remote(late)
            cause = info.value.cause
            assert isinstance(cause, StaleCheckpoint), (kind, cause)
            assert isinstance(cause, CheckpointError)
            assert cause.code == "stale_checkpoint"
        # ...and over HTTP, on the bearer-protected control route.
        client = ControlClient(
            fleet.urls["environment"], token=config.token, limit=4, limit_per_host=4
        )
        try:
            with pytest.raises(StaleCheckpoint):
                await client.call("commit", late)
        finally:
            await client.aclose()
        assert not (e2e.tmp / "late").exists()
        await rollouts.wait(timeout_s=60)
    assert_exactly_once(rollouts, tally, expected)
    await assert_clean(fleet)
