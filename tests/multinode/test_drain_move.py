"""A Ray node drain while rollouts run, watched by `coordination.triggers.drain`.

Worker A holds the environment and agent hosts; `ray drain-node --reason
DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N` drains it.  The
watcher (Ray's draining-node state, polled) checkpoints the whole Gym with
`stop` inside the deadline, the hosts of A come back under the same names on
the head, the whole Gym restores into fresh hosts, A goes away, and every
episode continues to the uninterrupted run's result.  A drain whose deadline
is too short is reported and nothing is attempted: no checkpoint, no LATEST.

The actions here are the test's (a fleet of the reference servers it
launched); the coordinator-side ones, relaunching registered hosts, are not
built yet.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from coordination.client.handle import CoordinatorHandle
from coordination.demo.nodes import node_of
from coordination.demo.scenario import Rollouts, restore_and_continue
from coordination.triggers.drain import DrainOutcome, DrainWatcher, RayDrainSource
from coordination.triggers.signals import Budget
from participants.fleet import Fleet, FleetConfig, launch_fleet
from ray_ckpt.control.client import data_session
from tests.e2e.conftest import E2E, assert_exactly_once, stats_until
from tests.multinode.conftest import Nodes
from tests.multinode.test_node_loss import coordinator_on_a_worker, past_seed, spread

pytestmark = [pytest.mark.ray, pytest.mark.slow]

N, STEPS, SEED = 4, 10, 83


def drain(nodes: Nodes, node_id: str, seconds: int) -> None:
    run = subprocess.run(
        [
            str(Path(sys.executable).with_name("ray")),
            "drain-node",
            *("--address", nodes.cluster.address, "--node-id", node_id),
            *("--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot"),
            *("--deadline-remaining-seconds", str(seconds)),
        ],
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr[-2000:]


class FleetMove:
    """`DrainActions` over a fleet of reference servers and its rollouts."""

    def __init__(
        self,
        gym: CoordinatorHandle,
        kit: E2E,
        config: FleetConfig,
        fleet: Fleet,
        rollouts: Rollouts,
        session: aiohttp.ClientSession,
        head: str,
    ) -> None:
        self.gym, self.kit, self.config, self.fleet = gym, kit, config, fleet
        self.rollouts, self.session, self.head = rollouts, session, head
        self.scope: list[Any] = []
        self.continued: list[str] = []

    async def placement(self) -> dict[str, str]:
        return dict(self.fleet.placement)

    async def checkpoint(self, location: str, budget: Budget) -> Any:
        self.scope = self.rollouts.unfinished()
        async with asyncio.timeout(budget.wait_s):
            return await self.gym.acheckpoint(
                location,
                self.scope,
                resume=False,
                stop=True,
                prepare_s=budget.prepare_s,
                commit_s=budget.commit_s,
            )

    async def relaunch(self, hosts: list[str], avoid: list[str]) -> dict[str, str]:
        await self.rollouts.abandon()  # their calls wait on stopped servers
        self.fleet.kill()  # every host: a restore installs one point in time
        await self.gym.aresume()  # the open checkpoint (kept for the move) is done
        placement = {k: (self.head if n in avoid else n) for k, n in self.fleet.placement.items()}
        self.fleet = await launch_fleet(self.config, placement=placement)
        self.kit.fleets.append(self.fleet)
        return {h: self.fleet.placement[h] for h in hosts}

    async def restore(self, location: str) -> Any:
        cont = await restore_and_continue(
            self.gym, self.fleet, self.session, location, self.scope, self.rollouts
        )
        self.continued = cont.continued
        return cont


async def watch_until_handled(watcher: DrainWatcher) -> DrainOutcome:
    for _ in range(200):  # the GCS learns of the drain a moment after it is accepted
        out = await watcher.poll_once()
        if out is not None:
            return out
        await asyncio.sleep(0.05)
    raise AssertionError("the drain was never seen")


async def test_a_drained_node_s_hosts_move_and_every_episode_continues(
    nodes: Nodes, mn: E2E
) -> None:
    config = mn.config(suffix="dr1")
    expected = await mn.baseline(config, N, STEPS, SEED)
    gym = coordinator_on_a_worker(mn)
    b = await node_of(gym.actor)
    a = nodes.other(b)
    fleet = await spread(mn, config, edge=a, core=b)
    rollouts, tally = mn.rollouts(N, STEPS, SEED)
    root = mn.tmp / "root"
    async with data_session(256, 256) as session:
        for r in rollouts.tasks:
            rollouts.start(session, fleet.urls["environment"], r)
        await stats_until(fleet, past_seed(rollouts), "every rollout past its seed step")
        move = FleetMove(gym, mn, config, fleet, rollouts, session, nodes.head)
        watcher = DrainWatcher(RayDrainSource(), move, str(root), margin_s=1.0)
        drain(nodes, a, 30)
        out = await watch_until_handled(watcher)
        assert out.ok, out.error
        assert move.scope, "episodes were in flight at the drain's checkpoint"
        assert out.nodes == [a]
        assert out.hosts == ["agent", "environment"]
        assert out.moved == {"agent": nodes.head, "environment": nodes.head}
        assert out.deadline is not None
        assert out.seconds < out.budget_s
        assert move.continued, "a rollout continued from its restored boundary"
        nodes.remove(a)  # the preemption itself: nothing of ours is left on A
        await rollouts.wait(timeout_s=90)
    assert_exactly_once(rollouts, tally, expected)
    assert (root / Path(str(out.location)).name / "gym" / "_manifest.json").exists()
    assert await watcher.poll_once() is None  # handled once


async def test_a_drain_too_short_to_checkpoint_is_reported_and_publishes_nothing(
    nodes: Nodes, mn: E2E
) -> None:
    config = mn.config(suffix="dr2")
    gym = coordinator_on_a_worker(mn)
    b = await node_of(gym.actor)
    a = nodes.other(b)
    fleet = await spread(mn, config, edge=a, core=b)
    rollouts, _ = mn.rollouts(N, STEPS, SEED)
    root = mn.tmp / "root"
    async with data_session(256, 256) as session:
        for r in rollouts.tasks:
            rollouts.start(session, fleet.urls["environment"], r)
        move = FleetMove(gym, mn, config, fleet, rollouts, session, nodes.head)
        watcher = DrainWatcher(RayDrainSource(), move, str(root), margin_s=1.0, min_budget_s=5.0)
        drain(nodes, a, 3)
        out = await watch_until_handled(watcher)
        await rollouts.abandon()
    nodes.remove(a)
    assert not out.ok
    assert out.error is not None
    assert out.error["code"] == "deadline_exceeded"
    assert out.location is None
    assert move.scope == []  # no checkpoint was attempted
    assert not root.exists()  # nothing published, no LATEST
