"""Sandbox benchmark: snapshot and restore of a sandbox tree, against a raw copy.

    python benchmarks/sandbox.py --files 2000 --mb 200 --json

A `DirectorySandbox` holds a tree of `--files` files, `--mb` MB in all, of
random (incompressible) bytes, in sizes from a few KB to a few MB, spread
over nested subdirectories.  Every repetition builds it afresh (untimed)
and measures, with each pair of ours and the baseline in an order that
rotates per repetition (medians reported):

* full snapshot: the sandbox's first capture (the pause: the tree copied
  into its content store while hashed) plus the commit of one record
  holding the snapshot and its attachments through the storage layer
  (`FileRecordStore.write`: a records file, one fsync'd blob per distinct
  content, the manifest), then the Gym manifest that makes it a base for
  the next; its bytes are every file the checkpoint holds;
* raw copy (the baseline): `tar` of the tree into one file, fsync'd;
* incremental snapshot: 10 % of the files rewritten (new random bytes, same
  sizes), then a capture (its pause) and a commit over the full one as its
  base (the unchanged blobs are referenced, not written);
* restore: the incremental checkpoint read back (`FileRecordStore.read`:
  its records and every blob verified) and `DirectorySandbox.restore` into
  a fresh tree, against `tar -x` of the raw copy into a fresh directory.
  Before each, everything is synced and the checkpoint's and the tarball's
  pages are dropped from the cache, so both read from the disk.

Figures: `full_snapshot_s` and `raw_copy_s`; `incremental_bytes_ratio`
(the incremental checkpoint's bytes over the full one's; goal <= 0.12);
`capture_pause_ratio` (the incremental capture over the full capture;
goal <= 0.2); `restore_ratio` (read + restore over the untar; goal <= 1.3).
Progress on stderr; a table on stdout, or with --json one JSON object as
the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from ray_ckpt.sandbox import DirectorySandbox, SandboxHandle, SandboxSnapshot
from ray_ckpt.storage import write_gym_manifest
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.seam import FileRecordStore

KIND, INSTANCE = "environment", "sandboxes"
CHANGED = 0.10
GOALS = {"incremental_bytes_ratio": 0.12, "capture_pause_ratio": 0.2, "restore_ratio": 1.3}


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def layout(files: int, mb: float, seed: int = 0) -> list[tuple[str, int]]:
    """(path, size) of every file: log-normal sizes summing to `mb` MB, in
    twenty directories of three subdirectories each."""
    rng = random.Random(seed)
    weights = [rng.lognormvariate(0.0, 1.0) for _ in range(files)]
    total = mb * 1e6
    sizes = [max(1, int(total * w / sum(weights))) for w in weights]
    return [(f"d{i % 20:02d}/s{i % 3}/f{i:05d}.bin", size) for i, size in enumerate(sizes)]


def du(path: str) -> int:
    """The bytes of every file under `path`."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def settle(*evict: str) -> None:
    """Before each timed step, untimed: earlier steps' dirty pages written
    back, and the files under `evict` dropped from the page cache (clean
    pages go at once, no root needed), so what the step reads comes from
    the disk."""
    gc.collect()
    os.sync()
    for top in evict:
        for dirpath, _, names in os.walk(top):
            for name in names:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def timed(fn: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = await fn()
    return time.perf_counter() - t0, out


class Rep:
    """One repetition, in its own folder (removed afterwards)."""

    def __init__(self, work: str, rep: int, files: list[tuple[str, int]]) -> None:
        self.dir = os.path.join(work, f"rep{rep}")
        self.rep = rep
        self.files = files
        self.provider = DirectorySandbox(os.path.join(self.dir, "sandboxes"))
        self.store = FileRecordStore()
        self.checkpoints = os.path.join(self.dir, "checkpoints")
        self.handle: SandboxHandle | None = None
        self.m: dict[str, float] = {}

    async def build(self) -> None:
        h = self.handle = await self.provider.create("episode")
        for path, size in self.files:
            await self.provider.write_file(h, path, os.urandom(size))
        # Past the file system's timestamp tick: no file is "racily clean" by
        # accident of being written just before the first capture.
        await asyncio.sleep(0.05)

    def tree(self) -> str:
        assert self.handle is not None
        return str(self.provider.directory(self.handle))

    async def commit(self, name: str, captured: Any) -> tuple[float, int]:
        """A checkpoint of the one record (and the Gym manifest that makes it
        a base); (seconds, bytes it holds)."""
        where = os.path.join(self.checkpoints, name)
        record = Record(
            "episode",
            state={"sandbox": msgspec.to_builtins(captured.snapshot)},
            attachments=dict(captured.attachments),
        )

        def write() -> None:
            m = self.store.write(
                where,
                kind=KIND,
                instance=INSTANCE,
                checkpoint_id=name,
                records=[record],
                stop=self.store.new_stop(),
            )
            write_gym_manifest(where, checkpoint_id=name, manifests=[m])

        t0 = time.perf_counter()
        await asyncio.to_thread(write)
        return time.perf_counter() - t0, du(where)

    async def full(self) -> None:
        assert self.handle is not None
        h = self.handle
        settle()
        cap_s, captured = await timed(lambda: self.provider.capture(h))
        write_s, nbytes = await self.commit("full", captured)
        self.m.update(
            full_capture_s=cap_s,
            full_write_s=write_s,
            full_snapshot_s=cap_s + write_s,
            full_bytes=nbytes,
            full_copied_bytes=captured.copied_bytes,
        )

    async def raw_copy(self) -> None:
        tar = os.path.join(self.dir, "raw.tar")
        settle()
        t0 = time.perf_counter()
        await asyncio.to_thread(_tar, self.tree(), tar)
        self.m.update(raw_copy_s=time.perf_counter() - t0, raw_bytes=os.stat(tar).st_size)

    async def incremental(self) -> None:
        assert self.handle is not None
        h = self.handle
        rng = random.Random(self.rep)
        changed = rng.sample(self.files, max(1, round(len(self.files) * CHANGED)))
        for path, size in changed:
            await self.provider.write_file(h, path, os.urandom(size))
        await asyncio.sleep(0.05)
        settle()
        cap_s, captured = await timed(lambda: self.provider.capture(h))
        write_s, nbytes = await self.commit("incremental", captured)
        self.m.update(
            incremental_capture_s=cap_s,
            incremental_write_s=write_s,
            incremental_bytes=nbytes,
            incremental_copied_bytes=captured.copied_bytes,
            changed_bytes=sum(size for _, size in changed),
        )

    async def restore(self) -> None:
        where = os.path.join(self.checkpoints, "incremental")

        def read() -> tuple[SandboxSnapshot, dict[str, str]]:
            _, [record] = self.store.read(
                where, kind=KIND, instance=INSTANCE, select=lambda key: True
            )
            snapshot = msgspec.convert(record.state["sandbox"], SandboxSnapshot)
            return snapshot, dict(record.attachments or {})

        settle(self.checkpoints)
        t0 = time.perf_counter()
        snapshot, attachments = await asyncio.to_thread(read)
        read_s = time.perf_counter() - t0
        [h1] = await self.provider.restore([(snapshot, attachments)])
        restore_s = time.perf_counter() - t0
        self.m.update(restore_read_s=read_s, restore_s=restore_s)
        await self.provider.free(h1)

    async def untar(self) -> None:
        tar = os.path.join(self.dir, "raw.tar")
        out = os.path.join(self.dir, "untarred")
        os.mkdir(out)
        settle(tar)
        t0 = time.perf_counter()
        await asyncio.to_thread(_untar, tar, out)
        self.m["untar_s"] = time.perf_counter() - t0

    async def close(self) -> None:
        await self.provider.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _tar(tree: str, out: str) -> None:
    subprocess.run(["tar", "-cf", out, "-C", tree, "."], check=True)
    fsync_path(out)


def _untar(tar: str, out: str) -> None:
    subprocess.run(["tar", "-xf", tar, "-C", out], check=True)


async def one(work: str, rep: int, files: list[tuple[str, int]]) -> dict[str, float]:
    r = Rep(work, rep, files)
    try:
        await r.build()
        # Ours first in even repetitions, the baseline first in odd ones.
        pair: list[Callable[[], Awaitable[None]]] = [r.full, r.raw_copy]
        for step in pair if rep % 2 == 0 else pair[::-1]:
            await step()
        await r.incremental()
        pair = [r.restore, r.untar]
        for step in pair if rep % 2 == 0 else pair[::-1]:
            await step()
    finally:
        await r.close()
    return r.m


def figures(samples: list[dict[str, float]]) -> dict[str, Any]:
    med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    out: dict[str, Any] = dict(med)
    out["incremental_bytes_ratio"] = med["incremental_bytes"] / med["full_bytes"]
    out["capture_pause_ratio"] = med["incremental_capture_s"] / med["full_capture_s"]
    out["restore_ratio"] = med["restore_s"] / med["untar_s"]
    out["full_over_raw_copy"] = med["full_snapshot_s"] / med["raw_copy_s"]
    out["goals"] = {
        k: {"value": out[k], "goal": goal, "met": out[k] <= goal} for k, goal in GOALS.items()
    }
    return out


def table(out: dict[str, Any]) -> str:
    mb = 1e6
    rows = [
        ("full snapshot", f"{out['full_snapshot_s']:.3f} s", f"{out['full_bytes'] / mb:.1f} MB"),
        ("  its capture (pause)", f"{out['full_capture_s']:.3f} s", ""),
        ("  its commit", f"{out['full_write_s']:.3f} s", ""),
        ("raw copy (tar, fsync)", f"{out['raw_copy_s']:.3f} s", f"{out['raw_bytes'] / mb:.1f} MB"),
        (
            "incremental snapshot",
            f"{out['incremental_capture_s'] + out['incremental_write_s']:.3f} s",
            f"{out['incremental_bytes'] / mb:.1f} MB",
        ),
        ("  its capture (pause)", f"{out['incremental_capture_s']:.3f} s", ""),
        ("restore (read + restore)", f"{out['restore_s']:.3f} s", ""),
        ("  its read", f"{out['restore_read_s']:.3f} s", ""),
        ("raw restore (untar)", f"{out['untar_s']:.3f} s", ""),
    ]
    lines = [f"{name:<26} {t:>10} {b:>10}" for name, t, b in rows]
    for key, g in out["goals"].items():
        verdict = "met" if g["met"] else "NOT met"
        lines.append(f"{key:<26} {g['value']:>10.3f}   goal <= {g['goal']} ({verdict})")
    lines.append(f"{'full_over_raw_copy':<26} {out['full_over_raw_copy']:>10.3f}")
    return "\n".join(lines)


async def measure(args: argparse.Namespace, work: str) -> dict[str, Any]:
    files = layout(args.files, args.mb)
    samples = []
    for rep in range(args.reps):
        m = await one(work, rep, files)
        samples.append(m)
        progress(
            f"rep {rep + 1}/{args.reps}: full {m['full_snapshot_s']:.2f} s "
            f"(capture {m['full_capture_s']:.2f}), tar {m['raw_copy_s']:.2f} s; "
            f"incremental capture {m['incremental_capture_s']:.3f} s, "
            f"{m['incremental_bytes'] / 1e6:.1f} MB; restore {m['restore_s']:.2f} s, "
            f"untar {m['untar_s']:.2f} s"
        )
    out = {"files": args.files, "mb": args.mb, "reps": args.reps, **figures(samples)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--mb", type=float, default=200.0)
    ap.add_argument("--reps", type=int, default=3, help="repetitions (medians reported)")
    ap.add_argument("--dir", help="where to work (default: a fresh temp dir)")
    ap.add_argument("--json", action="store_true", help="last line: the JSON object")
    args = ap.parse_args(argv)
    if args.files < 1 or args.mb <= 0 or args.reps < 1:
        ap.error("--files, --mb and --reps must be positive")
    if shutil.which("tar") is None:
        ap.error("the raw-copy baseline needs the tar program")
    work = tempfile.mkdtemp(prefix="ray-ckpt-sandbox-bench-", dir=args.dir)
    try:
        progress(f"{args.files} files, {args.mb:g} MB, {args.reps} repetitions in {work}")
        out = asyncio.run(measure(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
