"""Benchmark: one full checkpoint cycle through the Coordinator actor.

For each P (default 4, 16, 64) it starts P participant host actors (a real
`ParticipantEngine` over a trivial always-ready participant, real file
storage), spread round-robin over the four kinds, and measures, interleaved
over several repetitions (medians reported):

- `cycle_s`: `checkpoint()` through the coordinator — prepare (4 groups),
  commit everywhere + Gym manifest, resume (4 groups) — with empty state;
- `rtt_s`: one Ray actor round trip to one host (a no-op method);
- `fanout_s`: one parallel fan-out of that no-op to all P hosts;
- `floor_s`: the cycle's sequential steps, each as one parallel fan-out of the
  no-op to that step's group, summed: prepare's four kind groups (P/4 each),
  commit's one group of all P, resume's four kind groups again.

`cycle_over_floor` = cycle_s / floor_s: what the coordinator adds to the Ray
round trips the protocol cannot avoid (1.0 = nothing).  Two more figures say
where the rest goes, measured from an async actor as the coordinator itself
makes its calls (awaiting a ref on an event loop costs more per call than the
driver's blocking `ray.get`):

- `actor_floor_s`: the floor's fan-outs made from such an actor
  (`cycle_over_actor_floor`);
- `participants_direct_s`: the cycle's own prepare, commit and resume calls
  from such an actor, without the coordinator (the participants' work,
  their commits' fsyncs included, plus the round trips), so
  `coordinator_own_s` = cycle_s - participants_direct_s is the coordinator's
  own share: the driver's call, the journal, the Gym manifest, its bookkeeping;
- `driver_direct_s`: the same calls made from the driver, the floor's own
  vantage point.  `participants_over_floor` = driver_direct_s / floor_s is a
  lower bound on `cycle_over_floor`: a coordinator that cost nothing would
  still wait for them.  `cycle_over_participants` = cycle_s / driver_direct_s
  is what the coordinator itself multiplies the cycle by.

`cycle_over_fanout` = cycle_s / (9 * fanout_s) is kept for comparison with earlier runs; it divides
by nine fan-outs to all P, while eight of the nine steps reach only P/4, so it
understates the coordinator's overhead.

The coordinator journals where it does by default, in Ray's GCS key-value
store (`--journal dir`: fsync'd files in a directory, as with `state_dir`).
The checkpoints are written to the temp directory's disk: the floor holds no
storage, so each participant's commit (its records file and manifest,
created durably) is part of what the cycle adds.

`--simulated N` measures the coordinator's own cost past what one machine
can host (`benchmarks/coordination_sim.py`): a real `CoordinatorCore` against
N in-process fake hosts, `coordinator_us_per_participant` for a full cycle
(goal <= 300 us), and the same at each `--scaling` size to show the growth is
linear.  With `--simulated` and no `--participants`, no Ray is started.

Progress goes to stderr; `--json` prints `{"runs": [...]}` (plus `simulated`,
`simulated_scaling` and `simulated_growth` with `--simulated`) as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

# Run as a script, this file's directory comes first on sys.path and its name
# would shadow the `coordination` package: put the repository root first.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0]) == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from ray_ckpt.gym_server.spec import NamedControlOps  # noqa: E402  (after the sys.path fix)

KINDS = ("environment", "model", "agent", "resources")


class EmptyParticipant:
    """Always at a boundary, exports nothing: the cycle measures coordination only."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def bind(self, notify: Callable[[], None]) -> None:
        pass

    def close_admission(self) -> None:
        pass

    def open_admission(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def report(self, limit: int) -> Any:
        from ray_ckpt.reports import PrepareReport

        return PrepareReport(ready=True)

    def live_executions(self) -> int:
        return 0

    def fresh(self) -> bool:
        return True

    async def export(self, scope: Sequence[Any] | None) -> list[Any]:
        return []

    async def install(self, records: Sequence[Any]) -> list[Any]:
        return []

    async def retire(self, episode_ids: Sequence[Any]) -> list[str]:
        return []

    async def delete_restored(self, keep: Sequence[Any]) -> list[str]:
        return []


class BenchHost(NamedControlOps):
    """A host over a real controller and an empty participant (the per-operation
    actor methods come from `NamedControlOps`, as in `ParticipantHost`)."""

    def __init__(self, kind: str, name: str) -> None:
        from ray_ckpt.control.engine import ParticipantEngine
        from ray_ckpt.settings import CheckpointSettings

        settings = CheckpointSettings.model_validate(
            {"enabled": True, "control_auth_token": "bench"}
        )
        self.ctrl = ParticipantEngine(EmptyParticipant(kind), instance=name, settings=settings)

    async def call(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.ctrl.handle(op, body)

    async def noop(self, body: dict[str, Any]) -> dict[str, Any]:
        return {}

    async def status(self) -> dict[str, Any]:
        return self.ctrl.status()


class FloorProbe:
    """An async actor making the floor's fan-outs as the coordinator makes
    its own: awaiting the object refs on an event loop, which costs more per
    call than the driver's blocking `ray.get` (the floor's vantage point)."""

    async def floor(self, groups: list[list[Any]], everyone: list[Any]) -> float:
        start = time.perf_counter()
        for group in [*groups, everyone, *groups[::-1]]:
            await asyncio.gather(*(h.noop.remote({}) for h in group))
        return time.perf_counter() - start

    async def direct(
        self, groups: list[list[Any]], everyone: list[Any], cid: str, where: str
    ) -> float:
        """The cycle's own participant calls, in its order, without the
        coordinator: what the participants and the round trips cost."""
        body = {"checkpoint_id": cid, "deadline_ts": time.time() + 60}
        commit = {**body, "checkpoint_dir": where, "episode_ids": None, "stop": False}
        start = time.perf_counter()
        for group in groups:
            await asyncio.gather(*(h.prepare.remote(body) for h in group))
        await asyncio.gather(*(h.commit.remote(commit) for h in everyone))
        for group in groups[::-1]:
            await asyncio.gather(*(h.resume.remote(body) for h in group))
        return time.perf_counter() - start


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_one(p: int, reps: int, workdir: str, journal: str = "gcs") -> dict[str, float | int]:
    import ray

    from coordination.client.connect import get_or_create_coordinator

    namespace = f"bench-coord-{p}-{os.getpid()}"
    t0 = time.monotonic()
    remote_host: Any = ray.remote(BenchHost)
    hosts: list[Any] = [
        remote_host.options(
            name=f"{KINDS[i % 4]}/h{i}", namespace=namespace, num_cpus=0, max_concurrency=100
        ).remote(KINDS[i % 4], f"h{i}")
        for i in range(p)
    ]
    ray.get([h.noop.remote({}) for h in hosts])
    # The journal where users keep it by default (Ray's GCS key-value store),
    # or, with --journal dir, a directory of fsync'd files.
    state_dir = os.path.join(workdir, f"state-{p}") if journal == "dir" else None
    coord = get_or_create_coordinator(namespace, state_dir=state_dir, auto_discover=False)
    ray.get([coord.register_actor.remote(KINDS[i % 4], f"h{i}", h) for i, h in enumerate(hosts)])
    progress(f"P={p}: {p} hosts up in {time.monotonic() - t0:.1f}s")

    def cycle(tag: str) -> float:
        start = time.perf_counter()
        ray.get(coord.checkpoint.remote(os.path.join(workdir, f"ck-{p}-{tag}")))
        return time.perf_counter() - start

    def rtt() -> float:
        start = time.perf_counter()
        ray.get(hosts[0].noop.remote({}))
        return time.perf_counter() - start

    def fanout(group: Sequence[Any] = hosts) -> float:
        start = time.perf_counter()
        ray.get([h.noop.remote({}) for h in group])
        return time.perf_counter() - start

    groups = [[h for i, h in enumerate(hosts) if i % 4 == k] for k in range(4)]
    groups = [g for g in groups if g]

    def floor() -> float:
        # The cycle's steps in its order: prepare by kind, commit to all, resume by kind.
        return sum(fanout(g) for g in groups) + fanout() + sum(fanout(g) for g in groups[::-1])

    probe: Any = ray.remote(FloorProbe).options(num_cpus=0).remote()

    def actor_floor() -> float:
        return float(ray.get(probe.floor.remote(groups, hosts)))

    def direct(tag: str) -> float:
        where = os.path.join(workdir, f"direct-{p}-{tag}")
        return float(ray.get(probe.direct.remote(groups, hosts, f"direct-{tag}", where)))

    def driver_direct(tag: str) -> float:
        """The cycle's own calls from the floor's vantage point (the driver's
        blocking `ray.get`): what any coordinator must wait for at least."""
        cid = f"driver-{tag}"
        body = {"checkpoint_id": cid, "deadline_ts": time.time() + 60}
        where = os.path.join(workdir, f"driver-{p}-{tag}")
        commit = {**body, "checkpoint_dir": where, "episode_ids": None, "stop": False}
        start = time.perf_counter()
        for group in groups:
            ray.get([h.prepare.remote(body) for h in group])
        ray.get([h.commit.remote(commit) for h in hosts])
        for group in groups[::-1]:
            ray.get([h.resume.remote(body) for h in group])
        return time.perf_counter() - start

    cycle("warm"), rtt(), fanout(), floor(), actor_floor(), direct("warm")
    driver_direct("warm")
    cycles, rtts, fanouts, floors, actor_floors, directs = [], [], [], [], [], []
    driver_directs = []
    for i in range(reps):  # interleaved, so drift hits them all alike
        rtts.append(rtt())
        fanouts.append(fanout())
        floors.append(floor())
        actor_floors.append(actor_floor())
        directs.append(direct(str(i)))
        driver_directs.append(driver_direct(str(i)))
        cycles.append(cycle(str(i)))
        progress(f"P={p} rep {i + 1}/{reps}: cycle {cycles[-1] * 1e3:.1f} ms")
    for h in hosts:
        ray.kill(h)
    ray.kill(coord)
    ray.kill(probe)
    cycle_s, fanout_s = statistics.median(cycles), statistics.median(fanouts)
    floor_s, actor_floor_s = statistics.median(floors), statistics.median(actor_floors)
    direct_s = statistics.median(directs)
    driver_direct_s = statistics.median(driver_directs)
    return {
        "participants": p,
        "cycle_s": cycle_s,
        "rtt_s": statistics.median(rtts),
        "fanout_s": fanout_s,
        "floor_s": floor_s,
        "cycle_over_floor": cycle_s / floor_s,
        "cycle_over_fanout": cycle_s / (9 * fanout_s),
        "actor_floor_s": actor_floor_s,
        "cycle_over_actor_floor": cycle_s / actor_floor_s,
        "participants_direct_s": direct_s,
        "coordinator_own_s": cycle_s - direct_s,
        "driver_direct_s": driver_direct_s,
        "participants_over_floor": driver_direct_s / floor_s,
        "cycle_over_participants": cycle_s / driver_direct_s,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument(
        "--participants",
        default=None,
        help="P values of real host actors (default 4,16,64; none with --simulated)",
    )
    ap.add_argument(
        "--simulated",
        type=int,
        default=None,
        metavar="N",
        help="also drive a real CoordinatorCore against N in-process fake hosts",
    )
    ap.add_argument(
        "--scaling",
        default="100,1000,5000",
        help="with --simulated: the sizes that show how the cost grows",
    )
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions (>= 3)")
    ap.add_argument(
        "--journal",
        choices=("gcs", "dir"),
        default="gcs",
        help="the coordinator's journal: Ray's GCS KV store (the default) or a directory",
    )
    ap.add_argument("--address", default=None, help="attach to a cluster instead of a local one")
    ap.add_argument("--json", action="store_true", help='last line: {"runs": [...]}')
    args = ap.parse_args(argv)
    default = "" if args.simulated else "4,16,64"
    sizes = [int(x) for x in (args.participants or default).split(",") if x]
    reps = max(args.reps, 3)
    out: dict[str, Any] = {}
    if args.simulated:
        out = simulated(args.simulated, [int(x) for x in args.scaling.split(",") if x], reps)
    if not sizes:
        if args.json:
            print(json.dumps({"runs": [], **out}))
        return 0

    import ray

    tmp = tempfile.mkdtemp(prefix="rcb", dir="/tmp")
    workdir = tempfile.mkdtemp(prefix="ray-ckpt-bench-")
    if args.address:
        ray.init(address=args.address, namespace="bench-coord", log_to_driver=False)
    else:
        ray.init(
            include_dashboard=False,
            _temp_dir=tmp,
            namespace="bench-coord",
            logging_level=30,  # WARNING
            log_to_driver=False,
        )
    runs = []
    try:
        for p in sizes:
            runs.append(run_one(p, reps, workdir, args.journal))
    finally:
        ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    header = (
        f"{'P':>4}  {'cycle ms':>9}  {'rtt ms':>7}  {'fanout ms':>9}  {'floor ms':>9}  "
        f"{'cycle/floor':>11}  {'cycle/(9*fanout)':>16}  {'actor floor ms':>14}  "
        f"{'cycle/actor floor':>17}  {'direct ms':>9}  {'coordinator ms':>14}  "
        f"{'driver direct ms':>16}  {'direct/floor':>12}  {'cycle/direct':>12}"
    )
    print(header if not args.json else "", file=sys.stdout if not args.json else sys.stderr)
    for r in runs:
        line = (
            f"{r['participants']:>4}  {r['cycle_s'] * 1e3:>9.1f}  {r['rtt_s'] * 1e3:>7.2f}  "
            f"{r['fanout_s'] * 1e3:>9.2f}  {r['floor_s'] * 1e3:>9.2f}  "
            f"{r['cycle_over_floor']:>11.2f}  {r['cycle_over_fanout']:>16.2f}  "
            f"{r['actor_floor_s'] * 1e3:>14.2f}  {r['cycle_over_actor_floor']:>17.2f}  "
            f"{r['participants_direct_s'] * 1e3:>9.1f}  {r['coordinator_own_s'] * 1e3:>14.1f}  "
            f"{r['driver_direct_s'] * 1e3:>16.1f}  {r['participants_over_floor']:>12.2f}  "
            f"{r['cycle_over_participants']:>12.2f}"
        )
        print(line, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"runs": runs, **out}))
    return 0


def simulated(n: int, scaling: list[int], reps: int) -> dict[str, Any]:
    """`{"simulated": {...}, "simulated_scaling": [...]}`, with a table on stderr."""
    from benchmarks.coordination_sim import run

    sizes = sorted({n, *scaling})
    rows = {int(r["participants"]): r for r in run(sizes, reps, progress)}
    progress(f"{'N':>6}  {'cycle ms':>9}  {'hosts ms':>9}  {'coordinator us/participant':>27}")
    for size in sizes:
        r = rows[size]
        progress(
            f"{size:>6}  {r['cycle_s'] * 1e3:>9.1f}  {r['hosts_s'] * 1e3:>9.1f}  "
            f"{r['coordinator_us_per_participant']:>27.1f}"
        )
    first, last = rows[sizes[0]], rows[sizes[-1]]
    growth = float(last["coordinator_us_per_participant"]) / max(
        float(first["coordinator_us_per_participant"]), 1e-9
    )
    progress(
        f"per-participant cost at N={sizes[-1]} over N={sizes[0]}: {growth:.2f}x "
        "(1.0 = linear total; a quadratic step would grow with N)"
    )
    main_row = rows[n]
    return {
        "simulated": {
            "participants": n,
            "cycle_s": main_row["cycle_s"],
            "coordinator_us_per_participant": main_row["coordinator_us_per_participant"],
        },
        "simulated_scaling": [rows[s] for s in sizes],
        "simulated_growth": growth,
    }


if __name__ == "__main__":
    sys.exit(main())
