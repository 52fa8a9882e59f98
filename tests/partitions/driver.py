"""The driver of one partition scenario: a Ray driver in the head's namespace.

`ip netns exec <head> python -m tests.partitions.driver SCENARIO ARGS_JSON`.

Why a subprocess in a namespace: the test process stays in the host's
network namespace, which must never be wired to the test network; a Ray
driver needs a raylet on its own address, so it runs beside the head's.  The
test process owns the network: when a scenario wants a fault it writes a
request line (`@@{"fault": "cut", "node": "b"}`) and waits for the test's
answer on stdin; its last line is `@@{"summary": {...}}`, which the test
checks against the invariants (`tests/partitions/invariants.py`).

The fleet is the reference fleet of the end-to-end suite (`E2E.config`),
placed like the multi-node suite's: the coordinator on a worker node (it may
be restarted on another one), the environment and agent (the *edge*) on the
other worker, the model and resources on the head.  Every server binds its
node's address so that the coordinator and the other servers reach it
across the (cuttable) links.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from coordination.actor.actor_options import coordinator_options
from coordination.actor.coordinator import Coordinator
from coordination.client.handle import CoordinatorHandle
from coordination.demo.nodes import node_of

# The demo's placement, deadlines and lease: one story, told by both.
from coordination.demo.partition import CORE, EDGE, LEASE_S, TIMEOUTS, WORKER
from coordination.demo.scenario import Rollouts, restore_and_continue
from participants.fleet import Fleet, FleetConfig, launch_fleet
from ray_ckpt.control.client import data_session
from ray_ckpt.errors import CheckpointError
from ray_ckpt.storage import verify_checkpoint
from ray_ckpt.storage.blobstore.locations import join_location, open_location
from ray_ckpt.storage.root.pointer import read_latest
from tests.e2e.conftest import E2E, Tally, stats_until

N, STEPS, SEED = 4, 3, 83
COORDINATOR = "part-coordinator"


def say(obj: dict[str, Any]) -> None:
    sys.stdout.write("@@" + json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


async def ask(**request: Any) -> dict[str, Any]:
    """A fault (or a heal) done by the test process; its answer."""
    say(request)
    line = await asyncio.to_thread(sys.stdin.readline)
    answer: dict[str, Any] = json.loads(line)
    if not answer.get("ok"):
        raise RuntimeError(f"the test refused {request}: {answer}")
    return answer


@dataclass
class Run:
    name: str
    namespace: str
    root: str
    rng: random.Random
    kit: E2E
    config: FleetConfig
    nodes: dict[str, str] = field(default_factory=dict)  # name -> node ID
    ips: dict[str, str] = field(default_factory=dict)  # node ID -> address
    events: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    percent: int = 10  # the lossy link's drop rate
    cut_at: dict[str, float] = field(default_factory=dict)  # node -> monotonic time of its cut

    def event(self, what: str, **kw: Any) -> None:
        self.events.append({"t": round(time.monotonic() - self.started, 2), "what": what, **kw})

    async def cut(self, node: str) -> None:
        await ask(fault="cut", node=node)
        self.cut_at[node] = time.monotonic()
        self.event("cut", node=node)

    def name_of(self, node_id: str) -> str:
        return next(n for n, i in self.nodes.items() if i == node_id)

    def location(self, name: str) -> str:
        return join_location(self.root, name)

    async def launch(self, edge: str, core: str, **kw: Any) -> Fleet:
        placement = {
            **dict.fromkeys(EDGE, self.nodes[edge]),
            **dict.fromkeys(CORE, self.nodes[core]),
        }
        listen = {kind: self.ips[node] for kind, node in placement.items()}
        fleet = await launch_fleet(self.config, placement=placement, listen=listen, **kw)
        self.kit.fleets.append(fleet)
        return fleet

    def coordinator(self) -> CoordinatorHandle:
        """On some worker node; restartable (Ray may move it)."""
        opts = {
            **coordinator_options(self.namespace, name=COORDINATOR),
            "resources": {WORKER: 0.01},
        }
        actor = ray.remote(Coordinator).options(**opts).remote(self.namespace, timeouts=TIMEOUTS)
        handle = CoordinatorHandle(actor, self.namespace)
        self.kit.coordinators.append(handle)
        return handle

    async def checkpoint(
        self, gym: CoordinatorHandle, name: str, scope: list[Any], **kw: Any
    ) -> dict[str, Any]:
        """One checkpoint: its outcome (ok or the typed error's code), as recorded."""
        t0 = time.monotonic()
        record: dict[str, Any] = {"name": name}
        try:
            await gym.acheckpoint(self.location(name), scope, **kw)
            record["outcome"] = "ok"
        except CheckpointError as exc:
            record["outcome"] = exc.code
            record["detail"] = str(exc)[:300]
        record["seconds"] = round(time.monotonic() - t0, 2)
        self.checkpoints.append(record)
        self.event("checkpoint", **record)
        return record

    async def until_dead(self, node: str, timeout_s: float = 60.0) -> float:
        """Seconds from the cut until Ray declared `node` dead (polled from the
        GCS's node table)."""
        t0 = self.cut_at[node]
        while time.monotonic() - t0 < timeout_s:
            alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
            if not alive.get(self.nodes[node], True):
                return time.monotonic() - t0
            await asyncio.sleep(0.1)
        raise AssertionError(f"Ray did not declare {node} dead in {timeout_s}s")

    def snapshot(self, name: str) -> dict[str, float]:
        """Every object under a checkpoint and when it was written (to see late writes)."""
        blobs = open_location(self.location(name))
        return {info.key: info.modified for info in blobs.list()}

    def summary(self, rollouts: Rollouts, tally: Tally, expected: dict[str, str]) -> dict[str, Any]:
        blobs = open_location(self.root)
        pointer = read_latest(blobs)
        latest: dict[str, Any] | None = None
        if pointer is not None:
            report = verify_checkpoint(self.location(pointer.name))
            latest = {"name": pointer.name, "checkpoint_id": pointer.checkpoint_id, "ok": report.ok}
        verified = {
            c["name"]: verify_checkpoint(self.location(c["name"])).ok for c in self.checkpoints
        }
        return {
            "scenario": self.name,
            "expected": expected,
            "digests": rollouts.digests(),
            "finished": dict(tally.finished),
            "attempts": dict(tally.attempt),
            "failures": dict(rollouts.failures),
            "latest": latest,
            "checkpoints": self.checkpoints,
            "verified": verified,
            "events": self.events,
        }


def past_seed(rollouts: Rollouts) -> Callable[[dict[str, dict[str, Any]]], bool]:
    def check(stats: dict[str, dict[str, Any]]) -> bool:
        env = stats["environment"]
        n = len(rollouts.tasks)
        return bool(env["live_episodes"] == n and env.get("seeds", 0) >= n)

    return check


async def phases(fleet: Fleet, kinds: tuple[str, ...], timeout_s: float = 5.0) -> dict[str, str]:
    out: dict[str, str] = {}
    for kind in kinds:
        status = await asyncio.wait_for(fleet.hosts[kind].status.remote(), timeout_s)
        out[kind] = status["phase"]
    return out


async def until(probe: Callable[[], Awaitable[bool]], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


# --- scenarios ---------------------------------------------------------------------


async def participant_cut(run: Run) -> dict[str, Any]:
    """The edge node is cut while a checkpoint is open (every host prepared):
    the commit fails typed within its deadline and the rest resume; Ray
    declares the node dead; the lost members are relaunched on the head and
    restored from LATEST (the last complete checkpoint); the link heals while
    they continue; nothing lands in any checkpoint afterwards."""
    expected = await run.kit.baseline(run.config, N, STEPS, SEED)
    gym = run.coordinator()
    home = run.name_of(await node_of(gym.actor))
    edge = next(n for n in ("b", "c") if n != home)
    fleet = await run.launch(edge=edge, core="a")
    gym.discover()
    rollouts, tally = run.kit.rollouts(N, STEPS, SEED)
    async with data_session(256, 256) as session:
        for r in rollouts.tasks:
            rollouts.start(session, fleet.urls["environment"], r)
        await stats_until(fleet, past_seed(rollouts), "every rollout past its seed step")
        scope = rollouts.unfinished()
        first = await run.checkpoint(gym, "c1", scope)
        assert first["outcome"] == "ok", first

        await gym.aprepare()
        await run.cut(edge)
        t0 = time.monotonic()
        try:
            await gym.acommit(run.location("c2"), rollouts.unfinished())
            outcome = "ok"
        except CheckpointError as exc:
            outcome = exc.code
        run.checkpoints.append({"name": "c2", "outcome": outcome, "seconds": time.monotonic() - t0})
        run.event("commit during the cut", outcome=outcome, seconds=round(time.monotonic() - t0, 2))
        # The rest resumed: the head's hosts are idle again (not held to their lease).
        await until(
            lambda: _all_idle(fleet, CORE),
            "the head's hosts resumed",
            timeout_s=TIMEOUTS["resume_s"] + 5,
        )
        run.event("rest resumed")

        detected = await run.until_dead(edge)
        run.event("declared dead", node=edge, after_s=round(detected, 2))
        c2_at_death = run.snapshot("c2")

        # Lost members relaunched on the head and restored from LATEST.
        await rollouts.abandon()
        fleet.kill()  # the survivors too: a restore installs one point in time
        fresh = await run.launch(edge="a", core="a")
        latest = read_latest(open_location(run.root))
        assert latest is not None
        assert latest.name == "c1", latest
        cont = await restore_and_continue(
            gym, fresh, session, run.location(latest.name), scope, rollouts
        )
        run.event("restored", continued=cont.continued, restarted=cont.restarted)

        heal_after = run.rng.uniform(0.5, 2.0)
        await asyncio.sleep(heal_after)
        await ask(fault="heal", node=edge)
        run.event("healed", node=edge, after_s=round(heal_after, 2))
        third = await run.checkpoint(gym, "c3", rollouts.unfinished())
        await rollouts.wait(timeout_s=120)
        gone = await ask(fault="wait_gone", node=edge)
        run.event("zombie processes gone", **gone)

    out = run.summary(rollouts, tally, expected)
    out["detected_s"] = detected
    out["commit_during_cut"] = outcome
    out["late_writes"] = {"c2": sorted(set(run.snapshot("c2").items()) - set(c2_at_death.items()))}
    out["continued"] = cont.continued
    out["third"] = third
    return out


async def _all_idle(fleet: Fleet, kinds: tuple[str, ...]) -> bool:
    try:
        return set((await phases(fleet, kinds)).values()) == {"idle"}
    except Exception:  # a host not answering yet
        return False


async def lossy_link(run: Run) -> dict[str, Any]:
    """The edge node's link drops a share of packets both ways across several
    checkpoints: each completes whole or fails typed with nothing published;
    once healed, no host stays closed past its lease and every rollout ends once."""
    expected = await run.kit.baseline(run.config, N, STEPS, SEED)
    gym = run.coordinator()
    home = run.name_of(await node_of(gym.actor))
    edge = next(n for n in ("b", "c") if n != home)
    fleet = await run.launch(edge=edge, core="a")
    gym.discover()
    rollouts, tally = run.kit.rollouts(N, STEPS, SEED)
    percent = run.percent
    async with data_session(256, 256) as session:
        for r in rollouts.tasks:
            rollouts.start(session, fleet.urls["environment"], r)
        await stats_until(fleet, past_seed(rollouts), "every rollout past its seed step")
        # delay_ms: netem's delay and reordering too, where the kernel has it.
        await ask(fault="lossy", node=edge, percent=percent, delay_ms=20)
        run.event("lossy", node=edge, percent=percent)
        for i in range(3):
            await run.checkpoint(gym, f"l{i}", rollouts.unfinished(), total_s=10.0)
            await asyncio.sleep(run.rng.uniform(0.1, 0.6))
        await ask(fault="heal", node=edge)
        run.event("healed", node=edge)
        # A one-way link (the node hears but is not heard) during a checkpoint,
        # healed after a drawn time shorter than Ray's detection.
        one_way = asyncio.ensure_future(
            run.checkpoint(gym, "w", rollouts.unfinished(), total_s=10.0)
        )
        await ask(fault="one_way", node=edge)
        held = run.rng.uniform(0.3, 1.0)
        await asyncio.sleep(held)
        await ask(fault="heal", node=edge)
        run.event("one-way healed", node=edge, after_s=round(held, 2))
        await one_way
        # No participant is left closed: each is idle by its lease at the latest.
        await until(
            lambda: _all_idle(fleet, ("environment", "model", "agent", "resources")),
            "every host idle after the heal",
            timeout_s=LEASE_S + 15,
        )
        run.event("all idle")
        await rollouts.wait(timeout_s=120)
        last = await run.checkpoint(gym, "after", [])
    out = run.summary(rollouts, tally, expected)
    out["after"] = last
    return out


async def restore_cut(run: Run) -> dict[str, Any]:
    """A fleet restoring on the edge node loses it mid-restore (the environment's
    read is held): the restore fails whole; once Ray declares the node dead a
    fresh fleet on the head restores LATEST and every rollout continues."""
    from tests.e2e.test_crash_matrix import stalls

    expected = await run.kit.baseline(run.config, N, STEPS, SEED)
    gym = run.coordinator()
    home = run.name_of(await node_of(gym.actor))
    edge = next(n for n in ("b", "c") if n != home)
    fleet = await run.launch(edge="a", core="a")
    gym.discover()
    rollouts, tally = run.kit.rollouts(N, STEPS, SEED)
    async with data_session(256, 256) as session:
        for r in rollouts.tasks:
            rollouts.start(session, fleet.urls["environment"], r)
        await stats_until(fleet, past_seed(rollouts), "every rollout past its seed step")
        scope = rollouts.unfinished()
        first = await run.checkpoint(gym, "c1", scope)
        assert first["outcome"] == "ok", first
        await rollouts.abandon()
        fleet.kill()

        gate = str(run.kit.tmp / "gate-never")
        with stalls("environment", gate=gate, read=True):
            doomed = await run.launch(edge=edge, core="a")
        restoring = asyncio.ensure_future(gym.arestore(run.location("c1"), scope))
        # The other hosts install; the environment waits at its gate.
        await asyncio.sleep(run.rng.uniform(0.5, 1.5))
        await run.cut(edge)
        t0 = time.monotonic()
        try:
            await restoring
            outcome = "ok"
        except CheckpointError as exc:
            outcome = exc.code
        run.event(
            "restore during the cut", outcome=outcome, seconds=round(time.monotonic() - t0, 2)
        )
        detected = await run.until_dead(edge)
        run.event("declared dead", node=edge, after_s=round(detected, 2))
        doomed.kill()
        fresh = await run.launch(edge="a", core="a")
        latest = read_latest(open_location(run.root))
        assert latest is not None
        assert latest.name == "c1", latest
        cont = await restore_and_continue(gym, fresh, session, run.location("c1"), scope, rollouts)
        run.event("restored", continued=cont.continued, restarted=cont.restarted)
        await ask(fault="heal", node=edge)
        run.event("healed", node=edge)
        await rollouts.wait(timeout_s=120)
        gone = await ask(fault="wait_gone", node=edge)
        run.event("zombie processes gone", **gone)
    out = run.summary(rollouts, tally, expected)
    out["restore_during_cut"] = outcome
    out["detected_s"] = detected
    out["continued"] = cont.continued
    return out


async def fencing(fleet: Fleet) -> dict[str, Any]:
    """Each host's newest coordinator epoch and its fenced calls, by kind."""
    out: dict[str, Any] = {}
    for kind, host in fleet.ordered():
        status = await asyncio.wait_for(host.status.remote(), 10.0)
        out[kind] = {"epoch": status.get("coordinator_epoch"), "fenced": status.get("fenced", {})}
    return out


async def until_file_open(checkpoint_dir: str, kind: str, timeout_s: float = 30.0) -> None:
    """The kind's temporary records file exists: its write is under way."""
    pdir = Path(checkpoint_dir) / "gym" / kind

    async def open_tmp() -> bool:
        return pdir.exists() and any(p.name.endswith(".tmp") for p in pdir.rglob("*"))

    await until(open_tmp, f"a write of {kind} into {checkpoint_dir}", timeout_s)


async def coordinator_cut(run: Run, *, mid_checkpoint: bool) -> dict[str, Any]:
    """The coordinator's node is cut.  Ray restarts the coordinator on the
    other worker with a newer epoch, while the old one still runs.

    Mid-checkpoint: the environment's write into c2 is held, so the old
    coordinator is waiting on its commit when it is cut off; the new one
    recovers from the journal and aborts c2 (every host resumes long before
    its lease); after the heal the write is let go, the old coordinator's
    late work meets participants that have seen the newer epoch, and c2
    never becomes LATEST.  Idle: the new coordinator checkpoints as before.
    Either way the rollouts finish exactly once with the uninterrupted results."""
    from tests.e2e.test_crash_matrix import stalls

    expected = await run.kit.baseline(run.config, N, STEPS, SEED)
    gym = run.coordinator()
    home = run.name_of(await node_of(gym.actor))
    other = next(n for n in ("b", "c") if n != home)
    gate = str(run.kit.tmp / "gate")
    with stalls("environment", gate=gate, write_dir="c2"):
        fleet = await run.launch(edge=other, core="a")
    gym.discover()
    rollouts, tally = run.kit.rollouts(N, STEPS, SEED)
    async with data_session(256, 256) as session:
        for r in rollouts.tasks:
            rollouts.start(session, fleet.urls["environment"], r)
        await stats_until(fleet, past_seed(rollouts), "every rollout past its seed step")
        first = await run.checkpoint(gym, "c1", rollouts.unfinished())
        assert first["outcome"] == "ok", first
        old_epoch = (await gym.astatus()).epoch
        run.event("old coordinator", node=home, epoch=old_epoch)

        pending: asyncio.Future[Any] | None = None
        if mid_checkpoint:
            pending = asyncio.ensure_future(
                gym.acheckpoint(run.location("c2"), rollouts.unfinished())
            )
            await until_file_open(run.location("c2"), "environment")
            run.event("c2 open: the environment's write held")
        await run.cut(home)
        detected = await run.until_dead(home)
        run.event("declared dead", node=home, after_s=round(detected, 2))
        if pending is not None:
            try:
                await pending
                outcome = "ok"
            except Exception as exc:  # the actor died under the call
                outcome = getattr(exc, "code", type(exc).__name__)
            run.checkpoints.append({"name": "c2", "outcome": outcome})
            run.event("c2 through the old coordinator", outcome=outcome)

        async def restarted() -> bool:
            try:
                status = await asyncio.wait_for(gym.astatus(), 5.0)
            except Exception:
                return False
            return status.epoch is not None and old_epoch is not None and status.epoch > old_epoch

        await until(restarted, "the coordinator restarted with a newer epoch", 60.0)
        new_epoch = (await gym.astatus()).epoch
        new_home = run.name_of(await node_of(gym.actor))
        run.event("new coordinator", node=new_home, epoch=new_epoch)
        # The open checkpoint (if any) is aborted: every host idle, long before its lease.
        kinds = ("environment", "model", "agent", "resources")
        await until(lambda: _all_idle(fleet, kinds), "every host resumed", timeout_s=LEASE_S)
        run.event("all idle")

        heal_after = run.rng.uniform(0.5, 2.0)
        await asyncio.sleep(heal_after)
        await ask(fault="heal", node=home)
        run.event("healed", node=home, after_s=round(heal_after, 2))
        # The held write goes on; its reply goes to the old coordinator.
        await asyncio.to_thread(Path(gate).write_text, "go")
        gone = await ask(fault="wait_gone", node=home)
        run.event("old coordinator's node ended", **gone)
        seen = await fencing(fleet)
        run.event("fencing", **seen)

        third = await run.checkpoint(gym, "c3", rollouts.unfinished())
        seen_end = await fencing(fleet)
        await rollouts.wait(timeout_s=120)

    out = run.summary(rollouts, tally, expected)
    out.update(
        old_epoch=old_epoch,
        new_epoch=new_epoch,
        moved=(home, new_home),
        fencing=seen,
        fencing_end=seen_end,
        detected_s=detected,
        third=third,
        fenced_total=sum(sum(v["fenced"].values()) for v in seen.values()),
    )
    return out


async def coordinator_cut_mid_checkpoint(run: Run) -> dict[str, Any]:
    return await coordinator_cut(run, mid_checkpoint=True)


async def coordinator_cut_idle(run: Run) -> dict[str, Any]:
    return await coordinator_cut(run, mid_checkpoint=False)


SCENARIOS: dict[str, Callable[[Run], Awaitable[dict[str, Any]]]] = {
    "coordinator_cut_mid_checkpoint": coordinator_cut_mid_checkpoint,
    "coordinator_cut_idle": coordinator_cut_idle,
    "participant_cut": participant_cut,
    "lossy_link": lossy_link,
    "restore_cut": restore_cut,
}


def make_bucket(bucket: str, timeout_s: float = 60.0) -> None:
    """The bucket on the endpoint in the S3 namespace (it may still be starting)."""
    import boto3  # type: ignore[import-untyped]

    client = boto3.client("s3")  # AWS_ENDPOINT_URL and keys: the nodes' env
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.create_bucket(Bucket=bucket)
            return
        except client.exceptions.BucketAlreadyOwnedByYou:
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


async def main(scenario: str, args: dict[str, Any]) -> None:
    namespace = f"part-{scenario}-{os.getpid()}"
    ray.init(
        address=args["gcs"],
        _node_ip_address=args["ip"],
        namespace=namespace,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    root = args["root"]
    if root.startswith("s3://"):
        await asyncio.to_thread(make_bucket, root.split("/")[2])
    kit = E2E(namespace, Path(args["tmp"]))
    config = kit.config(suffix=scenario.replace("_", "-"), lease_grace_seconds=LEASE_S)
    run = Run(scenario, namespace, root, random.Random(args["seed"]), kit, config)
    run.percent = int(args.get("percent", run.percent))
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        for res in node["Resources"]:
            if res.startswith("node_"):
                run.nodes[res[len("node_") :]] = node["NodeID"]
                run.ips[node["NodeID"]] = node["NodeManagerAddress"]
    try:
        summary = await SCENARIOS[scenario](run)
    except BaseException as exc:
        say({"error": f"{type(exc).__name__}: {exc}", "events": run.events})
        raise
    finally:
        kit.close()
    say({"summary": summary})


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))
