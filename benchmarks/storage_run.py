"""One mix of the storage benchmark: interleaved repetitions in one location, medians.

Each repetition writes (commit, peer, raw, and the incremental commit) and
then reads (restore, peer, raw, the chain restore) in an order that rotates
per repetition, so a slow moment of a shared machine falls on a different
figure each time; the medians are reported.  The chain and the incremental's
full base are written once per mix, before the repetitions, untimed.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import pathlib
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

from storage_baselines import (
    DiskRaw,
    RawStore,
    StoreRaw,
    digest_of,
    encode_chunks,
    peer_commit,
    peer_restore,
    raw_read,
    raw_read_decode,
)
from storage_data import PeakRss
from storage_incremental import Chain, written_mb

from ray_ckpt.storage import Blobs, LocalBlobs, open_location, read_participant, write_participant
from ray_ckpt.storage.records.record import Record, check_json


class Location:
    """A fresh folder of the benchmark's location (a directory or a store prefix)."""

    def __init__(self, location: str) -> None:
        self.url = f"{location.rstrip('/')}/ray-ckpt-bench-{uuid.uuid4().hex[:12]}"
        self.blobs = open_location(self.url)
        self.on_disk = isinstance(self.blobs, LocalBlobs)
        self.raw: RawStore = DiskRaw(pathlib.Path(self.url)) if self.on_disk else StoreRaw(self.url)

    def at(self, sub: str) -> Blobs:
        return open_location(f"{self.url}/{sub}")

    def settle(self) -> None:
        """Before each timed step, untimed: every step starts from the same state.

        No earlier step's dirty pages are still being written back, and the
        memory an earlier step freed (a restore frees hundreds of MB) is given
        back to the OS, so no step inherits pages another one faulted in.
        Without it, at full size, the raw read + decode of the numbers mix
        (always run after the peer's restore) took 3.3-5.4 s against
        restore's 2.5-2.9 s: its floor looked beaten."""
        gc.collect()
        _malloc_trim()
        if self.on_disk:
            os.sync()
            self._evict()

    def _evict(self) -> None:
        """Drop the location's files from the page cache (clean pages go at
        once, no root needed): every read starts from the disk.  Our commit
        and the raw write go around the cache (O_DIRECT), but the chain,
        written once and read in every repetition, was served from the cache
        from the second repetition on: its restore looked faster than the
        full one it is compared with (`chain_restore_ratio` 0.75-0.84 in
        three runs, 3 GB/s for its bare reads against 0.5 GB/s for the full
        file)."""
        for dirpath, _dirs, files in os.walk(self.url):
            for name in files:
                try:
                    fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                except FileNotFoundError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

    def remove(self, sub: str = "") -> None:
        if self.on_disk:
            shutil.rmtree(pathlib.Path(self.url, sub), ignore_errors=True)
            return
        keys = [info.key for info in self.blobs.list(sub)]
        self.blobs.delete(keys)


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):  # glibc only
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


Add = Callable[[str, float], None]


def _commit(where: Blobs, cid: str, records: list[Record]) -> Any:
    return write_participant(where, kind="bench", instance="p0", checkpoint_id=cid, records=records)


def _restore(where: Blobs) -> list[Record]:
    _, restored = read_participant(where, kind="bench", instance="p0", checkpoint_id=None)
    return restored


def _one_rep(
    rep: int, loc: Location, records: list[Record], chunks: list[bytes], chain: Chain, add: Add
) -> None:
    base = f"rep{rep}"
    ours = loc.at(f"{base}/ours")
    nbytes = sum(len(c) for c in chunks)
    digest = digest_of(chunks)

    def commit() -> None:
        with PeakRss() as mem:
            t, m = _timed(lambda: _commit(ours, f"c{rep}", records))
        if (m.bytes, m.digest) != (nbytes, digest):
            # The raw baselines must write exactly our bytes, or they bound nothing.
            raise RuntimeError("the raw baseline's bytes are not our records file's")
        add("commit_s", t)
        add("commit_rss_mb", mem.growth_mb)
        add("full_mb", written_mb(ours, m))

    def incremental() -> None:
        t, mb = _timed(lambda: chain.incremental(f"inc-{rep}"))
        add("inc_commit_s", t)
        add("inc_mb", mb)

    def peer() -> None:
        add("peer_commit_s", _timed(lambda: peer_commit(loc.blobs, f"{base}/peer", records))[0])

    def raw() -> None:
        add("raw_write_s", _timed(lambda: loc.raw.write(f"{base}/raw", chunks))[0])
        if isinstance(loc.raw, DiskRaw):  # the same bytes through the page cache
            for mode, name in (("hint", "raw_write_buffered_s"), ("plain", "raw_write_plain_s")):
                other = f"{base}/raw-{mode}"
                loc.settle()
                add(name, _timed(partial(loc.raw.write, other, chunks, mode=mode))[0])
                os.unlink(pathlib.Path(loc.url, other))

    def restore() -> None:
        with PeakRss() as mem:
            t, restored = _timed(lambda: _restore(ours))
        if len(restored) != len(records):
            raise RuntimeError(f"restored {len(restored)} of {len(records)} records")
        del restored
        add("restore_s", t)
        add("restore_rss_mb", mem.growth_mb)

    def chain_restore() -> None:
        t, n = _timed(chain.restore_tip)
        if n != len(records):
            raise RuntimeError(f"the chain restored {n} of {len(records)} records")
        add("chain_restore_s", t)
        loc.settle()
        add("raw_chain_read_s", _timed(chain.raw_tip_read)[0])

    def peer_read() -> None:
        with PeakRss() as mem:
            t, _ = _timed(lambda: peer_restore(loc.blobs, f"{base}/peer"))
        add("peer_restore_s", t)
        add("peer_restore_rss_mb", mem.growth_mb)

    def raw_reads() -> None:
        add("raw_read_s", _timed(lambda: raw_read(loc.raw, f"{base}/raw"))[0])
        add("raw_read_decode_s", _timed(lambda: raw_read_decode(loc.raw, f"{base}/raw"))[0])

    writes: list[Callable[[], None]] = [commit, incremental, peer, raw]
    reads: list[Callable[[], None]] = [restore, chain_restore, peer_read, raw_reads]
    for group in (writes, reads):
        k = rep % len(group)
        for step in group[k:] + group[:k]:
            loc.settle()
            step()
    add("records_mb", nbytes / 1e6)
    add("peer_mb", loc.blobs.info(f"{base}/peer").size / 1e6)


def run_mix(
    mix: str, records: list[Record], reps: int, loc: Location, fraction: float
) -> dict[str, float]:
    samples: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    add("check_s", _timed(lambda: [check_json(r.state, episode=r.key) for r in records])[0])
    chunks = encode_chunks(records)
    print(f"[{mix}] writing the incremental chain", file=sys.stderr, flush=True)
    chain = Chain(f"{loc.url}/{mix}-chain", records, fraction)
    for rep in range(reps):
        _one_rep(rep, loc, records, chunks, chain, add)
        loc.remove(f"rep{rep}")
        loc.remove(f"{mix}-chain/inc-{rep}")
        cur = {k: round(v[-1], 3) for k, v in samples.items() if k != "check_s"}
        print(f"[{mix} {rep + 1}/{reps}] {cur}", file=sys.stderr, flush=True)
    return {k: float(statistics.median(v)) for k, v in samples.items()}
