"""Benchmark: how long a checkpoint pauses the Gym, synchronous vs asynchronous commit.

`--hosts` (default 4) host actors, each a real `ParticipantEngine` over
a participant holding its share of `--sessions` (default 1,000) states of
35 or 350 KB (the storage benchmark's text mix, `benchmarks/storage_data.py`),
real files (every checkpoint full).  Each host serves a steady load of data
requests on its own event loop (a request waits while admission is closed,
as a Gym server parks them).  For each mode {sync, async} x each size,
interleaved over `--reps` repetitions (medians):

- `pause_s`: the longest time any host's admission was closed;
- `durable_s`: from the call until the checkpoint is durable (sync: the call
  returns; async: `durable()` returns);
- `served_ratio`: data requests served from the call until durable, over
  those served in a window as long just before, without a checkpoint;
- `rss_growth_mb`: the hosts' peak RSS growth over that window, summed
  (the write's buffers, and async: the captured copy);
- `capture_rss_mb`: async: the same growth from the call until each host
  resumes (the capture; `captured_mb` says how big the copy is, and
  `capture_rss_over_captured` compares them at the larger size); sync: the
  whole window's.

`async_over_sync_pause` and `async_durable_over_sync_commit` compare the
modes at 350 KB; `async_pause_350_over_35` says how the async pause grows
with the state.  Progress on stderr, a table on stdout; `--json` prints the
object as the last line.
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

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0]) == _HERE:
    sys.path[0] = os.path.dirname(_HERE)

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from ray_ckpt.gym_server.spec import NamedControlOps  # noqa: E402  (after the sys.path fix)

KINDS = ("environment", "model", "agent", "resources")
MODES = ("sync", "async")


class LoadedParticipant:
    """Always at a boundary, holding its sessions; parks requests while closed."""

    def __init__(self, kind: str, records: list[Any]) -> None:
        self.kind = kind
        self.records = records
        self.open = asyncio.Event()
        self.open.set()
        self.closed_at: float | None = None
        self.closures: list[tuple[float, float]] = []
        self.on_open: Callable[[], None] = lambda: None

    def bind(self, notify: Callable[[], None]) -> None:
        pass

    def close_admission(self) -> None:
        self.open.clear()
        self.closed_at = time.time()

    def open_admission(self) -> None:
        if self.closed_at is not None:
            self.closures.append((self.closed_at, time.time()))
            self.closed_at = None
        self.on_open()
        self.open.set()

    def ready(self) -> bool:
        return True

    def report(self, limit: int) -> Any:
        from ray_ckpt.reports import PrepareReport

        return PrepareReport(ready=True)

    def live_executions(self) -> int:
        return len(self.records)

    def fresh(self) -> bool:
        return True

    async def export(self, scope: Sequence[Any] | None) -> list[Any]:
        return list(self.records)

    async def install(self, records: Sequence[Any]) -> list[Any]:
        return []

    async def retire(self, episode_ids: Sequence[Any]) -> list[str]:
        return []

    async def delete_restored(self, keep: Sequence[Any]) -> list[str]:
        return []


class PauseHost(NamedControlOps):
    def __init__(self, kind: str, name: str, sessions: int, kb: int, offset: int) -> None:
        from benchmarks.storage_data import build
        from ray_ckpt.control.engine import ParticipantEngine
        from ray_ckpt.settings import CheckpointSettings
        from ray_ckpt.storage.records.record import Record
        from ray_ckpt.storage.seam import FileRecordStore

        records = [
            Record(f"r{offset + i}", r.state, version="0")
            for i, r in enumerate(build("text", sessions, kb))
        ]
        self.part = LoadedParticipant(kind, records)
        settings = CheckpointSettings.model_validate(
            {"enabled": True, "control_auth_token": "bench"}
        )
        self.ctrl = ParticipantEngine(
            self.part, instance=name, settings=settings, store=FileRecordStore(full_every=1)
        )
        self.served: list[float] = []
        self._load: asyncio.Task[None] | None = None
        self._rss: Any = None
        self._at_resume: float | None = None
        self.part.on_open = self._mark_resume

    async def call(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.ctrl.handle(op, body)

    async def status(self) -> dict[str, Any]:
        return self.ctrl.status()

    async def start_load(self, every_s: float) -> None:
        async def serve() -> None:
            while True:
                await self.part.open.wait()  # a parked request
                self.served.append(time.time())
                await asyncio.sleep(every_s)

        self._load = asyncio.get_running_loop().create_task(serve())

    async def served_between(self, a: float, b: float) -> int:
        return sum(1 for t in self.served if a <= t <= b)

    async def closed_s_since(self, since: float) -> float:
        spans = [(a, b) for a, b in self.part.closures if b >= since]
        return max((b - a for a, b in spans), default=0.0)

    async def rss_start(self) -> None:
        from benchmarks.storage_data import PeakRss

        self._rss = PeakRss()
        self._at_resume = None
        self._rss.__enter__()

    def _mark_resume(self) -> None:
        """The peak RSS growth up to the resume: the capture's (the
        asynchronous write starts after it)."""
        rss = self._rss
        if rss is not None and self._at_resume is None:
            rss.peak = max(rss.peak, rss._proc.memory_info().rss)
            self._at_resume = float(rss.growth_mb)

    async def rss_at_resume(self) -> float:
        return self._at_resume if self._at_resume is not None else 0.0

    async def rss_stop(self) -> float:
        self._rss.__exit__(None, None, None)
        return float(self._rss.growth_mb)


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def one(coord: Any, hosts: list[Any], mode: str, where: str) -> dict[str, float]:
    import ray

    from coordination.client.handle import CoordinatorHandle

    gym = CoordinatorHandle(coord, "bench-pause")
    ray.get([h.rss_start.remote() for h in hosts])
    start = time.time()
    captured = 0
    if mode == "async":
        pending = gym.checkpoint(where, commit_s=600.0, durability="async")
        capture_growth = sum(ray.get([h.rss_at_resume.remote() for h in hosts]))
        captured = pending.durable().captured_bytes
    else:
        gym.checkpoint(where, commit_s=600.0)
    end = time.time()
    growth = sum(ray.get([h.rss_stop.remote() for h in hosts]))
    if mode != "async":
        capture_growth = growth
    window = end - start
    during = sum(ray.get([h.served_between.remote(start, end) for h in hosts]))
    time.sleep(min(window, 5.0) * 0.2)
    before = sum(ray.get([h.served_between.remote(start - window, start) for h in hosts]))
    pause = max(ray.get([h.closed_s_since.remote(start) for h in hosts]))
    return {
        "pause_s": pause,
        "durable_s": window,
        "served_ratio": during / before if before else 0.0,
        "rss_growth_mb": growth,
        "capture_rss_mb": capture_growth,
        "captured_mb": captured / 1e6,
    }


def run(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    import ray

    from coordination.client.connect import get_or_create_coordinator

    per_host = args.sessions // args.hosts
    fleets: dict[int, tuple[Any, list[Any]]] = {}
    for kb in args.kb:
        t0 = time.monotonic()
        ns = f"bench-pause-{kb}-{os.getpid()}"
        remote: Any = ray.remote(PauseHost)
        hosts = [
            remote.options(
                name=f"{KINDS[i % 4]}/p{i}", namespace=ns, num_cpus=0, max_concurrency=100
            ).remote(KINDS[i % 4], f"p{i}", per_host, kb, i * per_host)
            for i in range(args.hosts)
        ]
        ray.get([h.start_load.remote(args.request_every_s) for h in hosts])
        coord = get_or_create_coordinator(ns, auto_discover=False)
        ray.get(
            [coord.register_actor.remote(KINDS[i % 4], f"p{i}", h) for i, h in enumerate(hosts)]
        )
        fleets[kb] = (coord, hosts)
        progress(
            f"{kb} KB: {args.hosts} hosts x {per_host} sessions up in {time.monotonic() - t0:.1f}s"
        )
    time.sleep(1.0)  # a baseline window of load before the first checkpoint
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    for rep in range(args.reps):  # interleaved: drift hits every configuration alike
        for kb in args.kb:
            for mode in MODES:
                coord, hosts = fleets[kb]
                where = os.path.join(workdir, f"{mode}-{kb}-{rep}")
                m = one(coord, hosts, mode, where)
                samples.setdefault((mode, kb), []).append(m)
                shutil.rmtree(where, ignore_errors=True)
                progress(
                    f"rep {rep + 1}/{args.reps} {mode:>5} {kb:>3} KB: pause {m['pause_s']:.3f}s, "
                    f"durable {m['durable_s']:.3f}s, served {m['served_ratio']:.2f}"
                )
    for coord, hosts in fleets.values():
        for h in hosts:
            ray.kill(h)
        ray.kill(coord)
    runs = []
    for (mode, kb), ms in samples.items():
        runs.append(
            {
                "mode": mode,
                "sessions": per_host * args.hosts,
                "kb": kb,
                **{k: statistics.median(m[k] for m in ms) for k in ms[0]},
            }
        )
    by = {(r["mode"], r["kb"]): r for r in runs}
    out: dict[str, Any] = {"runs": runs}
    big, small = max(args.kb), min(args.kb)
    out["async_over_sync_pause"] = by[("async", big)]["pause_s"] / by[("sync", big)]["pause_s"]
    out["async_pause_350_over_35"] = by[("async", big)]["pause_s"] / by[("async", small)]["pause_s"]
    out["async_durable_over_sync_commit"] = (
        by[("async", big)]["durable_s"] / by[("sync", big)]["durable_s"]
    )
    captured = by[("async", big)]["captured_mb"]
    out["capture_rss_over_captured"] = (
        by[("async", big)]["capture_rss_mb"] / captured if captured else None
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=1000, help="in total, over the hosts")
    ap.add_argument("--kb", type=lambda s: [int(x) for x in s.split(",")], default=[35, 350])
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (>= 1)")
    ap.add_argument("--request-every-s", type=float, default=0.002, help="each host's load")
    ap.add_argument("--json", action="store_true", help="last line: the JSON object")
    args = ap.parse_args(argv)
    if len(args.kb) < 2:
        ap.error("--kb needs two sizes (the small and the large one)")

    import ray

    tmp = tempfile.mkdtemp(prefix="rcp", dir="/tmp")
    workdir = tempfile.mkdtemp(prefix="ray-ckpt-pause-")
    ray.init(
        include_dashboard=False,
        _temp_dir=tmp,
        namespace="bench-pause",
        logging_level=30,
        log_to_driver=False,
    )
    try:
        out = run(args, workdir)
    finally:
        ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    stream = sys.stderr if args.json else sys.stdout
    print(
        f"{'mode':>5} {'KB':>4} {'sessions':>8} {'pause s':>8} {'durable s':>9} "
        f"{'served':>7} {'RSS MB':>7} {'capture RSS':>11} {'captured MB':>11}",
        file=stream,
    )
    for r in sorted(out["runs"], key=lambda r: (r["kb"], r["mode"] != "sync")):
        print(
            f"{r['mode']:>5} {r['kb']:>4} {r['sessions']:>8} {r['pause_s']:>8.3f} "
            f"{r['durable_s']:>9.3f} {r['served_ratio']:>7.2f} {r['rss_growth_mb']:>7.1f} "
            f"{r['capture_rss_mb']:>11.1f} {r['captured_mb']:>11.1f}",
            file=stream,
        )
    ratio = out["capture_rss_over_captured"]
    print(
        f"async/sync pause at {max(args.kb)} KB: {out['async_over_sync_pause']:.2f} "
        "(goal <= 0.35); "
        f"async pause {max(args.kb)}/{min(args.kb)} KB: {out['async_pause_350_over_35']:.2f} "
        f"(goal <= 3); async durable / sync commit: {out['async_durable_over_sync_commit']:.2f} "
        f"(goal <= 1.15); capture RSS / captured bytes: "
        + (f"{ratio:.2f}" if ratio is not None else "-")
        + " (goal <= 1.2)",
        file=stream,
    )
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
