"""`ray-ckpt demo --nodes 3 --partition`: a node cut off, declared dead, healed.

The three Ray nodes run in network namespaces of their own
(`coordination/demo/netbed.py`: a head `a`, workers `b` and `c`, a bridge
in a switch namespace); this process joins the head's namespace for the run
(a Ray driver needs a raylet on its own address).  The story, as the
partition suite's participant cut tells it:

1. an uninterrupted run of the same seeds (the results to equal);
2. the fleet with the environment and agent on a worker (the *edge*, never
   the coordinator's node) and the model and resources on the head;
   rollouts, then checkpoint `c1` mid-flight;
3. checkpoint `c2` prepared, then the edge node's link is cut (its
   processes keep running): `c2`'s commit fails typed within its deadline;
   Ray declares the node dead (`detected_s`: the cut to that);
4. a fresh fleet on the head restores `c1` and continues every unfinished
   rollout as attempt + 1;
5. the link heals while the cut node's old servers still run: the zombie's
   late calls (each episode it held at the cut, sent on with the attempt it
   had then) reach the environment serving now, and must each be refused
   (`stale_attempt`); whatever the zombie wrote into `c2` after Ray declared
   it dead counts as tried too, refused when `c2` restores nowhere (not
   verified, not `LATEST`).

The report is the main run's plus `partitioned_node`, `detected_s`,
`zombie_attempts` and `zombie_refused` (all of them, or the run fails).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from coordination.cli.output import CliError, ExitCode
from coordination.demo import netbed
from coordination.demo.nodes import node_of
from coordination.demo.options import DemoOptions, fleet_config
from coordination.demo.report import DemoReport, Ui
from coordination.demo.scenario import (
    Rollouts,
    baseline,
    fleet_stats,
    restore_and_continue,
    wait_for_mixed_work,
)
from participants.fleet import Fleet, launch_fleet
from participants.rollout import run_episode
from ray_ckpt.control.client import data_session
from ray_ckpt.errors import CheckpointError, Reason
from ray_ckpt.identity import EpisodeId

NODES = 3
EDGE = ("environment", "agent")
CORE = ("model", "resources")
WORKER = "worker_node"  # the resource only the worker nodes have
COORDINATOR = "demo-coordinator"
# Deadlines short enough that a cut node fails a checkpoint in seconds.
TIMEOUTS = {
    "prepare_s": 8.0,
    "commit_s": 8.0,
    "resume_s": 8.0,
    "restore_s": 12.0,
    "reply_grace_s": 0.5,
    "status_s": 4.0,
}
LEASE_S = 10.0
DEAD_TIMEOUT_S = 60.0
# The refusals that fence a zombie's late call off.
FENCED = frozenset({Reason.STALE_ATTEMPT, Reason.STALE_CHECKPOINT, Reason.STALE_COORDINATOR})


def check_capabilities() -> None:
    """What `--partition` needs, or one `unavailable` error saying what is missing."""
    missing = netbed.capabilities()
    if missing:
        raise CliError(
            "--partition needs " + "; ".join(missing),
            ExitCode.UNAVAILABLE,
            hint="run it as root on Linux with iproute2 and nftables installed",
        )


def run_partition(opts: DemoOptions, ui: Ui) -> DemoReport:
    """The whole run: the test bed, its Ray nodes, the story; everything removed after."""
    ray_bin = str(Path(sys.executable).with_name("ray"))
    with netbed.bed(ray_bin) as bed:
        with ui.phase(f"start {NODES} Ray nodes in network namespaces", total=None):
            bed.start_node("a", cpus=2, resources={"node_a": 1.0})
            # The workers join the head at once (each `ray start` waits seconds).
            with ThreadPoolExecutor(2) as pool:
                joined = [
                    pool.submit(
                        bed.start_node, n, cpus=2, resources={f"node_{n}": 1.0, WORKER: 1.0}
                    )
                    for n in ("b", "c")
                ]
                for started in joined:
                    started.result()
        # The driver: Ray's settings as the nodes have them (no token auth
        # between addresses this bed made; several nodes on their own addresses).
        os.environ.update({k: v for k, v in bed.env().items() if k.startswith("RAY_")})
        with netbed.inside(bed.ns("a")):
            import ray

            ray.init(
                address=bed.gcs,
                _node_ip_address=bed.nodes["a"].ip,
                namespace=opts.namespace,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
            try:
                return asyncio.run(_story(opts, ui, bed))
            finally:
                ray.shutdown()


def _node_table() -> list[dict[str, Any]]:
    import ray

    table: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return table


def _nodes() -> tuple[dict[str, str], dict[str, str]]:
    """name -> node ID, node ID -> address, of the live nodes."""
    names: dict[str, str] = {}
    ips: dict[str, str] = {}
    for node in _node_table():
        if not node["Alive"]:
            continue
        for res in node["Resources"]:
            if res.startswith("node_"):
                names[res[len("node_") :]] = node["NodeID"]
                ips[node["NodeID"]] = node["NodeManagerAddress"]
    return names, ips


async def _until_dead(node_id: str, cut_at: float) -> float:
    """Seconds from the cut until the GCS's node table says the node is dead."""
    while time.monotonic() - cut_at < DEAD_TIMEOUT_S:
        alive = {n["NodeID"]: n["Alive"] for n in _node_table()}
        if not alive.get(node_id, True):
            return time.monotonic() - cut_at
        await asyncio.sleep(0.1)
    raise CliError(
        f"Ray did not declare the cut node dead within {DEAD_TIMEOUT_S:.0f} s",
        ExitCode.UNAVAILABLE,
    )


def _coordinator(namespace: str) -> Any:
    """The coordinator on a worker node (not the head: the head is never cut)."""
    import ray

    from coordination.actor.actor_options import coordinator_options
    from coordination.actor.coordinator import Coordinator
    from coordination.client.handle import CoordinatorHandle

    opts = {**coordinator_options(namespace, name=COORDINATOR), "resources": {WORKER: 0.01}}
    actor = ray.remote(Coordinator).options(**opts).remote(namespace, timeouts=TIMEOUTS)
    return CoordinatorHandle(actor, namespace)


def _snapshot(location: str) -> set[tuple[str, float]]:
    """Every object under a checkpoint and when it was written (to see late writes)."""
    from ray_ckpt.storage.blobstore.locations import open_location

    return {(info.key, info.modified) for info in open_location(location).list()}


async def _late_call(session: Any, env_url: str, episode: EpisodeId, task: dict[str, Any]) -> str:
    """One of the zombie's late requests, as the server serving now answers it:
    the refusal's code, or "served" (the old attempt was let through)."""
    try:
        await run_episode(session, env_url, episode, task, timeout_s=30.0)
    except CheckpointError as exc:
        return exc.code
    return "served"


async def _story(opts: DemoOptions, ui: Ui, bed: netbed.Bed) -> DemoReport:
    from ray_ckpt.storage import verify_checkpoint
    from ray_ckpt.storage.blobstore.locations import join_location, open_location
    from ray_ckpt.storage.root.pointer import read_latest

    ns = opts.namespace
    names, ips = _nodes()
    report = DemoReport(rollouts=opts.rollouts, steps=opts.steps, nodes=NODES)
    root = opts.checkpoint_dir or tempfile.mkdtemp(prefix="ray-ckpt-demo-")

    with ui.phase("uninterrupted run", total=opts.rollouts) as advance:
        first = await baseline(
            fleet_config(opts, suffix="baseline", namespace=ns),
            opts.rollouts,
            opts.steps,
            opts.seed,
            stagger_s=opts.stagger_s,
            advance=advance,
        )
    expected, base_stats, run_s = first.expected, first.stats, first.span_s

    gym = _coordinator(ns)
    home = await node_of(gym.actor)
    edge = next(n for n in ("b", "c") if names[n] != home)
    report.partitioned_node = edge
    config = msgspec.structs.replace(
        fleet_config(opts, suffix="", namespace=ns), lease_grace_seconds=LEASE_S
    )

    async def launch(edge_node: str) -> Fleet:
        placement = {
            **dict.fromkeys(EDGE, names[edge_node]),
            **dict.fromkeys(CORE, names["a"]),
        }
        listen = {kind: ips[node] for kind, node in placement.items()}
        return await launch_fleet(config, placement=placement, listen=listen)

    fleet = await launch(edge)
    report.placement["before"] = fleet.placement
    fresh: Fleet | None = None
    try:
        gym.discover()
        rollouts = Rollouts.make(opts.rollouts, opts.steps, opts.seed)
        async with data_session(1024, 512) as session:
            with ui.phase("rollouts until mid-flight", total=None):
                for i, rollout in enumerate(rollouts.tasks):
                    rollouts.start(
                        session, fleet.urls["environment"], rollout, delay_s=i * opts.stagger_s
                    )
                report.in_flight = await wait_for_mixed_work(fleet, rollouts, run_s * 0.6)
            with ui.phase("checkpoint c1 (prepare, commit)", total=None):
                prepared = await gym.aprepare()
                scope = rollouts.in_flight()
                committed = await gym.acommit(join_location(root, "c1"), scope)
                await gym.aresume()
            report.add_checkpoint(prepared, committed)
            before = await fleet_stats(fleet)

            with ui.phase(f"c2 prepared; cut node {edge}; c2's commit", total=None):
                await gym.aprepare()
                bed.cut(edge)
                cut_at = time.monotonic()
                try:
                    await gym.acommit(join_location(root, "c2"), rollouts.in_flight())
                    report.commit_during_cut = "ok"
                except CheckpointError as exc:
                    report.commit_during_cut = exc.code
            with ui.phase(f"Ray declares node {edge} dead", total=None):
                report.detected_s = await _until_dead(names[edge], cut_at)
            c2_at_death = _snapshot(join_location(root, "c2"))
            report.finished_before_crash = len(rollouts.results)

            with ui.phase("restore c1 into a fresh fleet on the head", total=None):
                await rollouts.abandon()
                fleet.kill()  # the head's hosts too: a restore installs one point in time
                fresh = await launch("a")
                report.placement["after"] = fresh.placement
                cont = await restore_and_continue(
                    gym, fresh, session, join_location(root, "c1"), scope, rollouts
                )
            report.add_restore(cont)

            with ui.phase(f"heal node {edge}; the zombie's late calls", total=None):
                bed.heal(edge)
                # Each episode the zombie held at the cut, sent on with the
                # attempt it had then, to the environment serving it now.
                held = [e for e in scope if rollouts.attempts.get(e.rollout_id, 0) > e.attempt]
                answers = await asyncio.gather(
                    *(
                        _late_call(
                            session,
                            fresh.urls["environment"],
                            e,
                            rollouts.tasks[e.rollout_id],
                        )
                        for e in held
                    )
                )
            tried: Counter[str] = Counter()
            refused: Counter[str] = Counter()
            for answer in answers:
                tried["late request with its old attempt"] += 1
                if answer in FENCED:
                    refused[answer] += 1

            with ui.phase("continued rollouts", total=len(rollouts.running)) as advance:
                rollouts.on_event = lambda _e, _r: advance()
                await rollouts.wait(timeout_s=300)
            after = await fleet_stats(fresh)
            # What the zombie wrote into c2 after Ray declared it dead: it lands
            # nowhere a restore reads if c2 never verifies and is not LATEST.
            late = _snapshot(join_location(root, "c2")) - c2_at_death
            if late:
                tried["late write into c2"] += len(late)
                latest = read_latest(open_location(root))
                c2_unread = not verify_checkpoint(join_location(root, "c2")).ok and (
                    latest is None or latest.name != "c2"
                )
                if c2_unread:
                    refused["unpublished (c2 restores nowhere)"] += len(late)
        report.zombie_tried = dict(tried)
        report.zombie_refused_by = dict(refused)
        report.compare(expected, rollouts, base=base_stats, before=before, after=after)
        return report
    finally:
        if fresh is not None:
            await fresh.stop()
        fleet.kill()
        import ray

        ray.kill(gym.actor, no_restart=True)
