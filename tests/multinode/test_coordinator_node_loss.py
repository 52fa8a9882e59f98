"""The coordinator's node goes away while a checkpoint is open.

The fleet runs on the head; the coordinator on a worker node, with its
journal where it lives by default: Ray's GCS key-value store.  Every host is
prepared (admission closed, leases long) when the coordinator's node is
removed.  Ray restarts the coordinator on the other worker
(`max_restarts=-1`); it finds its journal there and aborts the open
checkpoint at once: every host resumes long before its lease would lapse,
the rollouts carry on as attempt 0, a new checkpoint through the restarted
coordinator succeeds, and every rollout finishes exactly once with the
uninterrupted result.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from coordination.actor.actor_options import default_state_dir
from coordination.actor.gcs import kv_get, kv_key
from coordination.demo.nodes import node_of
from participants.fleet import KIND_ORDER, launch_fleet
from ray_ckpt.control.client import data_session
from ray_ckpt.storage import verify_checkpoint
from tests.e2e.conftest import E2E, assert_exactly_once, host_phases, reads_until, stats_until
from tests.multinode.conftest import Nodes
from tests.multinode.test_node_loss import (
    COORDINATOR,
    SEED,
    STEPS,
    N,
    coordinator_on_a_worker,
    past_seed,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

LEASE_GRACE_S = 120.0  # far longer than the test: a lapse cannot be what resumed them


def journal_in_gcs(namespace: str) -> bytes | None:
    return kv_get(kv_key(namespace, COORDINATOR))


def no_file_journal(namespace: str) -> bool:
    return not Path(default_state_dir(namespace, COORDINATOR)).exists()


async def test_coordinator_restarts_elsewhere_and_aborts_its_open_checkpoint(
    nodes: Nodes, mn: E2E
) -> None:
    config = mn.config(suffix="mn3", lease_grace_seconds=LEASE_GRACE_S)
    expected = await mn.baseline(config, N, STEPS, SEED)
    gym = coordinator_on_a_worker(mn, journal_in_tmp=False, prepare_s=60.0)
    first = await node_of(gym.actor)
    assert first in nodes.workers
    fleet = await launch_fleet(config, placement=dict.fromkeys(KIND_ORDER, nodes.head))
    mn.fleets.append(fleet)
    rollouts, tally = mn.rollouts(N, STEPS, SEED)
    async with data_session(256, 256) as session:
        for r in rollouts.tasks:
            rollouts.start(session, fleet.urls["environment"], r)
        await stats_until(fleet, past_seed(rollouts), "every rollout past its seed step")
        await gym.aprepare()
        assert set((await host_phases(fleet)).values()) == {"prepared"}
        # The journal is in the GCS, not in a node-local directory.
        assert journal_in_gcs(mn.namespace) is not None
        assert no_file_journal(mn.namespace)

        started = time.monotonic()
        nodes.remove(first)
        # Ray restarts it on the other worker; its recovery aborts the checkpoint.
        await reads_until(
            lambda: host_phases(fleet),
            lambda phases: set(phases.values()) == {"idle"},
            "every host resumed by the restarted coordinator",
            timeout_s=60,
        )
        assert time.monotonic() - started < LEASE_GRACE_S / 2
        assert await node_of(gym.actor) != first, "restarted on another node"
        status = await gym.astatus()
        assert status.open_checkpoint is None
        assert journal_in_gcs(mn.namespace) is None, "the aborted checkpoint is closed"

        # The restarted coordinator checkpoints as before.
        ckpt = str(mn.tmp / "after")
        await gym.acheckpoint(ckpt, rollouts.unfinished())
        assert verify_checkpoint(ckpt).ok
        await rollouts.wait(timeout_s=90)

    assert_exactly_once(rollouts, tally, expected)
    assert all(tally.attempt[r] == 0 for r in rollouts.tasks)
