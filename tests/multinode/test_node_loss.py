"""A whole node goes away: the fleet is spread over a head and two worker nodes.

Placement: the coordinator on a worker node (B: wherever Ray put it among
the workers), the environment and agent hosts on the other worker (A), the
policy model and resources hosts on B.  Checkpoints live on the
machine's disk, which every node of this cluster reaches (a shared file
system in a real one).

- After a checkpoint, worker A is removed mid-run.  The lost hosts are
  relaunched under the same names on the surviving nodes (the head); the
  survivors on worker B are replaced too: their state has moved past the
  checkpoint (the model's ledger holds calls made after it), and a restore
  installs one point in time into fresh processes, never on top of later
  state.  The checkpoint restores, every unfinished episode continues, and
  the results equal the uninterrupted run's.
- A node lost mid-commit: the second checkpoint is torn (refused whole) and
  the first restores.  Then a node lost mid-restore: that restore fails
  whole, and a second restore into a fleet on the survivors succeeds.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import ray

from coordination.actor.actor_options import coordinator_options
from coordination.actor.coordinator import Coordinator
from coordination.client.handle import CoordinatorHandle
from coordination.demo.nodes import node_of
from coordination.demo.scenario import Rollouts, restore_and_continue
from participants.fleet import Fleet, FleetConfig, launch_fleet
from ray_ckpt.control.client import data_session
from ray_ckpt.errors import CheckpointError
from ray_ckpt.storage import verify_checkpoint
from tests.e2e.conftest import E2E, assert_clean, assert_exactly_once, stats_until
from tests.e2e.test_crash_matrix import stalls
from tests.multinode.conftest import WORKER, Nodes

pytestmark = [pytest.mark.ray, pytest.mark.slow]

N, STEPS, SEED = 4, 3, 71
COORDINATOR = "mn-coordinator"
EDGE = ("environment", "agent")  # on the node that goes away
CORE = ("model", "resources")


def coordinator_on_a_worker(
    kit: E2E, *, journal_in_tmp: bool = True, **timeouts: float
) -> CoordinatorHandle:
    """The coordinator on some worker node: it asks for a sliver of the resource
    only worker nodes have (restartable, so never pinned to one node).  Its
    journal: under the test's tmp dir, or the default, Ray's GCS KV store."""
    opts = {
        **coordinator_options(kit.namespace, name=COORDINATOR),
        "resources": {WORKER: 0.01},
    }
    actor = (
        ray.remote(Coordinator)
        .options(**opts)
        .remote(
            kit.namespace,
            state_dir=str(kit.tmp / "coordinator") if journal_in_tmp else None,
            timeouts={"reply_grace_s": 0.5, **timeouts},
        )
    )
    handle = CoordinatorHandle(actor, kit.namespace)
    kit.coordinators.append(handle)
    return handle


async def spread(kit: E2E, config: FleetConfig, edge: str, core: str, **kw: Any) -> Fleet:
    placement = {**dict.fromkeys(EDGE, edge), **dict.fromkeys(CORE, core)}
    fleet = await launch_fleet(config, placement=placement, **kw)
    kit.fleets.append(fleet)
    assert fleet.placement == placement, fleet.placement
    return fleet


def past_seed(rollouts: Rollouts) -> Any:
    """Every rollout live and past its seed step (a boundary to continue from)."""

    def check(stats: dict[str, dict[str, Any]]) -> bool:
        env = stats["environment"]
        return env["live_episodes"] == len(rollouts.tasks) and env.get("seeds", 0) >= len(
            rollouts.tasks
        )

    return check


async def lose_node(nodes: Nodes, node_id: str, fleet: Fleet, rollouts: Rollouts) -> None:
    """Remove the node; the driver's calls to it are gone; release dead names."""
    nodes.remove(node_id)
    await rollouts.abandon()
    fleet.kill()  # the survivors too, and the dead handles (so the names free up)


async def test_node_lost_after_a_checkpoint_restores_on_the_survivors(
    nodes: Nodes, mn: E2E
) -> None:
    config = mn.config(suffix="mn1")
    expected = await mn.baseline(config, N, STEPS, SEED)
    gym = coordinator_on_a_worker(mn)
    b = await node_of(gym.actor)
    assert b in nodes.workers, "the coordinator runs on a worker node"
    a = nodes.other(b)
    fleet = await spread(mn, config, edge=a, core=b)
    rollouts, tally = mn.rollouts(N, STEPS, SEED)
    ckpt = str(mn.tmp / "c1")
    async with data_session(256, 256) as session:
        for r in rollouts.tasks:
            rollouts.start(session, fleet.urls["environment"], r)
        await stats_until(fleet, past_seed(rollouts), "every rollout past its seed step")
        scope = rollouts.unfinished()
        done = await gym.acheckpoint(ckpt, scope)
        assert verify_checkpoint(ckpt).ok
        assert set(done.episode_ids) == set(fleet.names.values())

        await asyncio.sleep(0.3)  # work goes on past the checkpoint, then A is gone
        await lose_node(nodes, a, fleet, rollouts)

        fresh = await spread(mn, config, edge=nodes.head, core=b)
        assert fresh.names == fleet.names
        cont = await restore_and_continue(gym, fresh, session, ckpt, scope, rollouts)
        assert cont.continued, "a rollout continued from its restored boundary"
        await rollouts.wait(timeout_s=90)

    assert_exactly_once(rollouts, tally, expected)
    await assert_clean(fresh)


async def test_node_lost_mid_commit_then_mid_restore(nodes: Nodes, mn: E2E) -> None:
    config = mn.config(suffix="mn2")
    expected = await mn.baseline(config, N, STEPS, SEED)
    gym = coordinator_on_a_worker(mn, commit_s=20.0, restore_s=20.0)
    b = await node_of(gym.actor)
    a = nodes.other(b)
    gate = str(mn.tmp / "gate")
    c1, c2 = str(mn.tmp / "c1"), str(mn.tmp / "c2")
    with stalls("environment", gate=gate, write_dir="c2"):
        fleet = await spread(mn, config, edge=a, core=b)
    rollouts, tally = mn.rollouts(N, STEPS, SEED)
    async with data_session(256, 256) as session:
        for r in rollouts.tasks:
            rollouts.start(session, fleet.urls["environment"], r)
        await stats_until(fleet, past_seed(rollouts), "every rollout past its seed step")
        scope = rollouts.unfinished()
        await gym.acheckpoint(c1, scope)

        # c2: the environment's write into c2 is held, with its temp file open.
        second = asyncio.ensure_future(gym.acheckpoint(c2, rollouts.unfinished()))
        await _until_file_open(Path(c2), "environment")
        await lose_node(nodes, a, fleet, rollouts)
        with pytest.raises(CheckpointError):
            await second
        assert not verify_checkpoint(c2).ok, "the torn commit is refused whole"

        # Restore c1 into a fleet whose edge runs on a new worker C, whose
        # environment read is held: C is lost mid-restore.
        c = nodes.add_worker()
        with stalls("environment", gate=gate + "-never", read=True):
            doomed = await spread(mn, config, edge=c, core=b)
        restoring = asyncio.ensure_future(gym.arestore(c1, scope))
        await asyncio.sleep(1.0)  # every other host installs; the environment waits
        nodes.remove(c)
        doomed.kill()
        with pytest.raises(CheckpointError):
            await restoring

        fresh = await spread(mn, config, edge=nodes.head, core=b)
        cont = await restore_and_continue(gym, fresh, session, c1, scope, rollouts)
        assert cont.continued
        await rollouts.wait(timeout_s=90)

    assert_exactly_once(rollouts, tally, expected)
    await assert_clean(fresh)


async def _until_file_open(checkpoint_dir: Path, kind: str, timeout_s: float = 20.0) -> None:
    """The kind's temporary records file exists: its write is under way."""
    pdir = checkpoint_dir / "gym" / kind
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if pdir.exists() and any(
            name.endswith(".tmp") for _, _, files in os.walk(pdir) for name in files
        ):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no write of {kind} into {checkpoint_dir} began")
