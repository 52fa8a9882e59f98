"""Benchmark: a CPU-bound Gym handler served by 1, 2 and 4 worker processes.

Each worker count runs the reference counter server (`participants/servers/
counter.py`) under one `ParticipantHost` in a process of its own (so the load
generator here never shares a process with a server): 1 worker is today's
single-process host, the baseline; 2 and 4 are `ray_ckpt.workers` hosts on a
shared port.  All three run at once (an idle one costs nothing) and
`--rounds` rounds alternate short windows between them, so a neighbour's
changing load hits every count alike (medians over the rounds):

- `throughput_rps`: `POST /work` (`--work` SHA-256 rounds, pure CPU) served
  per second by `--clients` concurrent clients over a `--window`, one
  connection per request (the kernel spreads connections, not requests);
- `cycle_s`: then one checkpoint (prepare, commit of `--rollouts` counters,
  resume) over the host's control routes, under the same load (with
  workers: the host's own control port, where the coordinator reaches it;
  alone: the one app's, behind its data work).

`speedup_2` = throughput(2) / throughput(1) (goal on 2 cores >= 1.6);
`cycle_4_over_1` = cycle(4) / cycle(1) (goal <= 1.5).  Also printed, measured
in the same run: the handler's pure CPU rate in this process (one core's
ceiling).  Progress on stderr, a table on stdout; `--json` prints
`{"runs": [{"workers", "throughput_rps", "cycle_s"}, ...], "speedup_2",
"cycle_4_over_1"}` as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if sys.path and os.path.abspath(sys.path[0]) == _HERE:
    sys.path[0] = _ROOT

import aiohttp  # noqa: E402  (after the sys.path fix)

from participants.servers.counter import cpu_work  # noqa: E402

TOKEN = "bench-workers-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CONTROL = "/ng-control/v1/checkpoint"
COUNTS = (1, 2, 4)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- the server process --------------------------------------------------------------


async def serve(workers: int) -> None:
    """Run one host until stdin closes; print its URL first."""
    from ray_ckpt.gym_server.spec import ServerSpec
    from ray_ckpt.hosting.host import ParticipantHost

    spec = ServerSpec(
        kind="resources",
        name="bench",
        factory="participants.servers.counter:counter_server",
        settings={"enabled": True, "control_auth_token": TOKEN, "lease_grace_seconds": 60.0},
        workers=workers,
        spreading="rollout",
    )
    host = ParticipantHost(spec)
    await host._ready()
    # Control calls go where the coordinator's reach the host: with workers,
    # the host's own control port; alone, the one app's (its data loop).
    control = host.plane.control_url if host.plane is not None else host.url
    print(f"URL {host.url} {control}", flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await host.stop()


class Server:
    def __init__(self, workers: int) -> None:
        env = {**os.environ, "PYTHONPATH": _ROOT}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", str(workers)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("URL "):
            self.stop()
            raise RuntimeError(f"server for {workers} workers did not start: {line!r}")
        self.url, self.control = line.split()[1:3]
        import psutil

        # The host's process and its workers (children), for the CPU they get.
        me = psutil.Process(self.proc.pid)
        self.procs = [me, *me.children(recursive=True)]

    def cpu_s(self) -> float:
        """CPU seconds the server's processes used so far."""
        return sum(sum(p.cpu_times()[:2]) for p in self.procs)

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- load and cycles ------------------------------------------------------------------


async def load(
    url: str, clients: int, work: int, stop: asyncio.Event, served: Counter[int]
) -> None:
    """Requests until `stop`, counted in `served` by the serving process's pid."""
    connector = aiohttp.TCPConnector(force_close=True, limit=clients)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            while not stop.is_set():
                async with session.post(f"{url}/work", json={"n": work}) as resp:
                    reply = await resp.json()
                    if resp.status == 200:
                        served[int(reply["pid"])] += 1

        await asyncio.gather(*(client() for _ in range(clients)))


async def control(session: aiohttp.ClientSession, url: str, op: str, body: Any) -> Any:
    async with session.post(f"{url}{CONTROL}/{op}", json=body, headers=AUTH) as resp:
        reply = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{op}: {resp.status} {reply}")
        return reply


async def cycle(session: aiohttp.ClientSession, url: str, cid: str, ckpt: str) -> float:
    body = {"checkpoint_id": cid, "deadline_ts": time.time() + 30.0}
    t0 = time.perf_counter()
    prepared = await control(session, url, "prepare", body)
    if prepared["phase"] != "prepared":
        raise RuntimeError(f"prepare: {prepared}")
    await control(session, url, "commit", {**body, "checkpoint_dir": ckpt})
    await control(session, url, "resume", body)
    return time.perf_counter() - t0


async def window(
    args: argparse.Namespace, server: Server, session: aiohttp.ClientSession, cid: str, ckpt: str
) -> dict[str, Any]:
    """One sample: throughput over a window, then one cycle under the same load."""
    stop = asyncio.Event()
    counted: Counter[int] = Counter()
    cpu0 = server.cpu_s()
    t0 = time.perf_counter()
    running = asyncio.ensure_future(load(server.url, args.clients, args.work, stop, counted))
    await asyncio.sleep(args.window)
    served = Counter(counted)
    elapsed = time.perf_counter() - t0
    cores = (server.cpu_s() - cpu0) / elapsed
    took = await cycle(session, server.control, cid, ckpt)
    stop.set()
    await running
    return {
        "served": served,
        "rps": sum(served.values()) / elapsed,
        "cores": cores,
        "cycle_s": took,
    }


async def run(
    args: argparse.Namespace, workdir: str
) -> tuple[dict[str, Any], float, dict[int, float]]:
    t0 = time.perf_counter()
    for _ in range(20):
        cpu_work(args.work)
    cpu_rps = 20 / (time.perf_counter() - t0)
    log(f"handler alone in this process: {cpu_rps:.1f} rps on one core")
    # Every count's server runs from the start (an idle one costs nothing),
    # and the rounds alternate short windows between them: under a
    # neighbour's changing load each count sees the same mix of quiet and
    # busy moments, which whole runs one after another do not.
    servers = {n: await asyncio.to_thread(Server, n) for n in COUNTS}
    rps: dict[int, list[float]] = {n: [] for n in COUNTS}
    cycles: dict[int, list[float]] = {n: [] for n in COUNTS}
    cores: dict[int, list[float]] = {n: [] for n in COUNTS}
    try:
        async with aiohttp.ClientSession() as session:
            for server in servers.values():
                for i in range(args.rollouts):  # state to export, over the workers
                    async with session.post(f"{server.url}/ng-rollout/r{i}/step", json={}) as r:
                        await r.read()
                stop = asyncio.Event()
                warm = asyncio.ensure_future(
                    load(server.url, args.clients, args.work, stop, Counter())
                )
                await asyncio.sleep(args.warmup)
                stop.set()
                await warm
            for rnd in range(args.rounds):
                for n, server in servers.items():
                    ckpt = os.path.join(workdir, f"w{n}-{rnd}")
                    sample = await window(args, server, session, f"c{rnd}", ckpt)
                    served: Counter[int] = sample["served"]
                    total = sum(served.values())
                    rps[n].append(sample["rps"])
                    cycles[n].append(sample["cycle_s"])
                    cores[n].append(sample["cores"])
                    share = max(served.values()) / max(total, 1)
                    log(
                        f"round {rnd + 1}/{args.rounds} workers={n}: {rps[n][-1]:.1f} rps on "
                        f"{cores[n][-1]:.2f} cores, "
                        f"cycle {sample['cycle_s'] * 1000:.1f} ms ({len(served)} pids, busiest "
                        f"{share:.0%}; load average {os.getloadavg()[0]:.1f})"
                    )
    finally:
        for server in servers.values():
            await asyncio.to_thread(server.stop)
    runs = [
        {
            "workers": n,
            "throughput_rps": round(statistics.median(rps[n]), 2),
            "cycle_s": round(statistics.median(cycles[n]), 4),
        }
        for n in COUNTS
    ]
    by = {r["workers"]: r for r in runs}
    out = {
        "runs": runs,
        "speedup_2": round(by[2]["throughput_rps"] / by[1]["throughput_rps"], 3),
        "cycle_4_over_1": round(by[4]["cycle_s"] / by[1]["cycle_s"], 3),
    }
    used = {n: statistics.median(cores[n]) for n in COUNTS}
    return out, cpu_rps, used


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=8, help="interleaved rounds (>= 1)")
    ap.add_argument("--window", type=float, default=1.5, help="throughput window, seconds")
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--clients", type=int, default=8, help="concurrent requests")
    ap.add_argument("--work", type=int, default=20_000, help="SHA-256 rounds per request")
    ap.add_argument("--rollouts", type=int, default=64, help="counters each checkpoint exports")
    ap.add_argument("--json", action="store_true", help="last line: the JSON object")
    args = ap.parse_args(argv)
    if args.serve is not None:
        asyncio.run(serve(args.serve))
        return 0
    workdir = tempfile.mkdtemp(prefix="ray-ckpt-bench-workers-")
    try:
        out, cpu_rps, used = asyncio.run(run(args, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    stream = sys.stderr if args.json else sys.stdout
    base = out["runs"][0]
    print(
        f"{'workers':>7} {'rps':>8} {'x 1 worker':>10} {'cores got':>9} {'rps/core':>8} "
        f"{'cycle ms':>9} {'x 1 worker':>10}",
        file=stream,
    )
    for r in out["runs"]:
        got = used[r["workers"]]
        print(
            f"{r['workers']:>7} {r['throughput_rps']:>8.1f} "
            f"{r['throughput_rps'] / base['throughput_rps']:>10.2f} {got:>9.2f} "
            f"{r['throughput_rps'] / max(got, 1e-9):>8.1f} "
            f"{r['cycle_s'] * 1000:>9.1f} {r['cycle_s'] / base['cycle_s']:>10.2f}",
            file=stream,
        )
    print(
        f"baselines: 1 worker = today's single-process host; the handler alone on one "
        f"core in this process: {cpu_rps:.1f} rps; 'cores got' = CPU seconds per second "
        f"the server's processes were given (cores here: {os.cpu_count()}; on a shared "
        "machine the kernel's autogroup scheduler gives this session's processes one "
        "session's share, whatever their number)",
        file=stream,
    )
    print(
        f"speedup_2: {out['speedup_2']:.2f} (goal >= 1.6); "
        f"cycle_4_over_1: {out['cycle_4_over_1']:.2f} (goal <= 1.5)",
        file=stream,
    )
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
