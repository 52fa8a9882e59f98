"""The coordinator's own drain watch: a drained node's hosts move, no step lost.

As `test_drain_move`, but nothing of the move runs in the driver: the
coordinator (on worker B) watches Ray's draining nodes itself
(`handle.start_drain_watch`), and on `ray drain-node` of worker A, which
holds the environment and agent hosts, it checkpoints the whole Gym with
`stop` inside the deadline, relaunches the fleet with nothing on A
(`FleetRelauncher`, run inside the coordinator) and restores it.  The driver
only sees its `/run` calls stop, reads the outcome from `drain_status()`, and
starts attempt + 1 of every unfinished rollout on the new environment; every
episode ends with the uninterrupted run's result.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray

from coordination.actor.drain_control import DrainStatus
from coordination.demo.nodes import node_of
from participants.fleet import KIND_ORDER, Fleet, FleetConfig
from participants.fleet_relaunch import FleetRelauncher
from ray_ckpt.control.client import data_session
from ray_ckpt.hosting.host import get_host
from tests.e2e.conftest import E2E, assert_exactly_once, stats_until, until
from tests.multinode.conftest import Nodes
from tests.multinode.test_drain_move import drain
from tests.multinode.test_node_loss import coordinator_on_a_worker, past_seed, spread

pytestmark = [pytest.mark.ray, pytest.mark.slow]

N, STEPS, SEED = 4, 10, 89


class InFlight:
    """The assembler: pauses with the Gym and names the episodes in flight."""

    def __init__(self) -> None:
        self.episodes: list[str] = []

    async def set(self, episodes: list[str]) -> None:
        self.episodes = episodes

    async def pause(self, checkpoint_id: str, deadline_s: float) -> None:
        return None

    async def resume(self, checkpoint_id: str) -> None:
        return None

    async def in_flight(self) -> list[str]:
        return self.episodes


async def relaunched(kit: E2E, config: FleetConfig) -> Fleet:
    """The fleet the coordinator relaunched, found by name (and stopped by the kit)."""
    fleet = Fleet(config)
    for kind in KIND_ORDER:
        fleet.hosts[kind] = get_host(kind, config.server_name(kind), namespace=config.namespace)
        info: dict[str, Any] = await fleet.hosts[kind].ready.remote()
        fleet.info[kind], fleet.urls[kind] = info, info["url"]
    kit.fleets.append(fleet)
    return fleet


async def test_the_coordinator_moves_a_drained_node_s_hosts_and_every_episode_continues(
    nodes: Nodes, mn: E2E
) -> None:
    config = mn.config(suffix="dw1")
    expected = await mn.baseline(config, N, STEPS, SEED)
    gym = coordinator_on_a_worker(mn)
    assembler = ray.remote(InFlight).options(namespace=mn.namespace, num_cpus=0).remote()
    await asyncio.to_thread(gym.register_assembler, assembler, scope_method="in_flight")
    b = await node_of(gym.actor)
    a = nodes.other(b)  # not the coordinator's node: it runs the move
    fleet = await spread(mn, config, edge=a, core=b)
    rollouts, tally = mn.rollouts(N, STEPS, SEED)
    root = mn.tmp / "root"
    async with data_session(256, 256) as session:
        for r in rollouts.tasks:
            rollouts.start(session, fleet.urls["environment"], r)
        await stats_until(fleet, past_seed(rollouts), "every rollout past its seed step")
        await assembler.set.remote([e.capture_key for e in rollouts.unfinished()])
        watch = await gym.astart_drain_watch(
            str(root), FleetRelauncher(config, to=nodes.head), poll_s=0.1, margin_s=1.0
        )
        assert watch.running
        drain(nodes, a, 40)

        async def handled() -> DrainStatus | None:
            st = await gym.adrain_status()
            return st if st.outcomes else None

        status = await until(handled, "the coordinator handled the drain", timeout_s=60)
        (out,) = status.outcomes
        await rollouts.abandon()  # their calls went to the old hosts
        assert out.ok, out.error
        assert out.nodes == [a]
        env_key = f"environment/{config.server_name('environment')}"
        agent_key = f"agent/{config.server_name('agent')}"
        assert out.hosts == sorted([agent_key, env_key])
        assert out.moved == {agent_key: nodes.head, env_key: nodes.head}
        assert out.seconds < out.budget_s + 30  # the move, after the checkpoint
        new = await relaunched(mn, config)
        assert new.placement["environment"] == nodes.head
        restored = set(out.restored.get(env_key, []))
        continued = []
        for episode in rollouts.unfinished():
            nxt = episode.next()
            if nxt.capture_key in restored:
                continued.append(episode.rollout_id)
            rollouts.start(
                session, new.urls["environment"], episode.rollout_id, attempt=nxt.attempt
            )
        assert continued, "a rollout continued from its restored boundary"
        nodes.remove(a)  # the preemption itself
        await rollouts.wait(timeout_s=90)
        stopped = await gym.astop_drain_watch()
        assert not stopped.running
    assert_exactly_once(rollouts, tally, expected)
    assert out.location is not None
    assert (root / out.location.rsplit("/", 1)[-1] / "gym" / "_manifest.json").exists()
    # The coordinator's timeline names what started the checkpoint.
    assert out.checkpoint_id is not None
    trace = await gym.atimeline(out.checkpoint_id)
    assert trace["otherData"]["trigger"] == "drain"
