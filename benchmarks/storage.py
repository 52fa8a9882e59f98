"""Storage benchmark: commit and restore of N sessions of S KB, against baselines.

    python benchmarks/storage.py --sessions 1000 --kb 350 --json

Two mixes of realistic state, measured separately: text-heavy (tool outputs:
nested dicts, long strings) and number-heavy (token ids and logprobs, with
NaN/inf/-0.0).  In one run, on the same data, each repetition measures (in
interleaved order, medians reported):

* commit: records -> durable records file -> manifest (`write_participant`);
* restore: read -> verify digest and count -> decode -> records in hand;
* peer baseline: one stdlib-json line per record through sha256, fsync,
  rename; restore reads the lines and `json.loads` each;
* physical baseline: a raw fsync'd sequential write of as many bytes as our
  records file; a raw read of that file (`raw_read_s`), and the same read
  followed by a bare decode of each state with no framing checks, digest or
  validation (`raw_read_decode_s`, the format's floor, which restore_ratio
  compares against).

The JSON-ness check of exported state (`check_json`) happens at export in
both designs, so it is timed on its own (`check_s`) and not in commit.
The last stdout line with --json is one JSON object; the top-level figures
add both mixes up, `mixes` holds each one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from ray_ckpt.storage import read_participant, write_participant
from ray_ckpt.storage.record import Record, check_json
from ray_ckpt.storage.records_format import FRAME, MAGIC, StateEncoder, decode_state

CHUNK = 4 << 20


def _text_pool(rng: random.Random) -> list[str]:
    words = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(2000)
    ] + ["é", "漢字", "→", '"quoted"', "\\path", "\n", "\t"]
    return [" ".join(rng.choices(words, k=rng.randint(200, 1200))) for _ in range(256)]


def text_state(i: int, kb: int, pool: list[str]) -> dict[str, Any]:
    state: dict[str, Any] = {"session": f"s{i}", "env": {"cwd": "/work", "files": {}}, "turns": []}
    size = 0
    j = i
    while size < kb * 1024:
        out = pool[j % len(pool)]
        state["turns"].append(
            {
                "role": "tool",
                "tool": "shell" if j % 3 else "search",
                "output": out,
                "meta": {"exit": j % 2, "ms": j * 7 % 9973, "ok": True, "tags": ["a", "b"]},
            }
        )
        size += len(out) + 90
        j += 7
    state["env"]["files"] = {f"f{k}.py": pool[(i + k) % len(pool)][:200] for k in range(5)}
    return state


def number_state(i: int, kb: int, floats: list[float], ids: list[int]) -> dict[str, Any]:
    n = kb * 1024 // 26  # ~19 bytes a logprob and ~7 a token id in JSON
    off = (i * 7919) % (len(floats) - n)
    lp = floats[off : off + n]
    lp[0:3] = [math.nan, math.inf, -0.0]
    return {
        "session": f"s{i}",
        "token_ids": ids[off : off + n],
        "logprobs": lp,
        "rewards": [{"step": k, "r": (k * 0.37) % 1 - 0.5} for k in range(8)],
    }


def build(mix: str, sessions: int, kb: int) -> list[Record]:
    rng = random.Random(7)
    if mix == "text":
        pool = _text_pool(rng)
        return [Record(f"r{i}", text_state(i, kb, pool)) for i in range(sessions)]
    n = kb * 1024 // 26
    floats = [rng.uniform(-25.0, 0.0) for _ in range(n + 20000)]
    ids = [rng.randrange(0, 152000) for _ in range(n + 20000)]
    return [Record(f"r{i}", number_state(i, kb, floats, ids)) for i in range(sessions)]


class PeakRss:
    """Samples RSS on a thread; `growth_mb` is the peak minus the start."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self.start: int = self._proc.memory_info().rss
        self.peak: int = self.start
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.start) / 1e6


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def peer_commit(directory: Path, records: list[Record]) -> Path:
    directory.mkdir()
    tmp = directory / ".records.jsonl.tmp"
    h = hashlib.sha256()
    with open(tmp, "wb") as f:
        for rec in records:
            line = (json.dumps({"key": rec.key, "state": rec.state}) + "\n").encode()
            h.update(line)
            f.write(line)
        f.flush()
        os.fsync(f.fileno())
    final = directory / f"records-{h.hexdigest()}.jsonl"
    os.replace(tmp, final)
    _fsync_dir(directory)
    return final


def peer_restore(path: Path) -> list[Any]:
    with open(path, "rb") as f:
        return [json.loads(line) for line in f]


def raw_write(path: Path, nbytes: int) -> None:
    block = os.urandom(CHUNK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, memoryview(block)[: min(left, CHUNK)])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    total = 0
    try:
        while data := os.read(fd, CHUNK):
            total += len(data)
    finally:
        os.close(fd)
    return total


def raw_read_decode(path: Path) -> list[Any]:
    """The format's floor: one read, then a bare decode of each state (no checks)."""
    with open(path, "rb") as f:
        data = f.read()
    view = memoryview(data)
    pos, out = len(MAGIC), []
    while pos < len(data):
        key_len, state_len = FRAME.unpack_from(data, pos)
        start = pos + FRAME.size + key_len
        out.append(decode_state(view[start : start + state_len]))
        pos = start + state_len
    return out


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _one_rep(
    rep: int, records: list[Record], base: Path, add: Callable[[str, float], None]
) -> None:
    """One repetition; the order of the three writes (and reads) rotates per rep."""
    cid = f"c{rep}"
    ours = base / "ours"
    base.mkdir(parents=True)
    # The raw write needs our file's size, known in advance from a dry encode.
    nbytes = records_size(records)
    paths: dict[str, Path] = {}

    def commit() -> None:
        with PeakRss() as mem:
            t, m = _timed(
                lambda: write_participant(
                    ours, kind="bench", instance="p0", checkpoint_id=cid, records=records
                )
            )
        assert m.bytes == nbytes
        paths["ours"] = ours / "gym" / "bench" / "p0" / m.records_file
        add("commit_s", t)
        add("commit_rss_mb", mem.growth_mb)

    def peer() -> None:
        t, paths["peer"] = _timed(lambda: peer_commit(base / "peer", records))
        add("peer_commit_s", t)

    def raw() -> None:
        add("raw_write_s", _timed(lambda: raw_write(base / "raw.bin", nbytes))[0])

    def restore() -> None:
        with PeakRss() as mem:
            t, (_, restored) = _timed(
                lambda: read_participant(ours, kind="bench", instance="p0", checkpoint_id=cid)
            )
        assert len(restored) == len(records)
        del restored
        add("restore_s", t)
        add("restore_rss_mb", mem.growth_mb)

    def peer_read() -> None:
        with PeakRss() as mem:
            t, _ = _timed(lambda: peer_restore(paths["peer"]))
        add("peer_restore_s", t)
        add("peer_restore_rss_mb", mem.growth_mb)

    def raw_reads() -> None:
        add("raw_read_s", _timed(lambda: raw_read(paths["ours"]))[0])
        add("raw_read_decode_s", _timed(lambda: raw_read_decode(paths["ours"]))[0])

    for group in ([commit, peer, raw], [restore, peer_read, raw_reads]):
        k = rep % len(group)
        for step in group[k:] + group[:k]:
            step()
    add("records_mb", nbytes / 1e6)
    add("peer_mb", paths["peer"].stat().st_size / 1e6)


def records_size(records: list[Record]) -> int:
    enc, total = StateEncoder(), len(MAGIC)
    for r in records:
        buf = bytearray()
        enc.append(buf, r.key, r.state)
        total += len(buf)
    return total


def run_mix(mix: str, records: list[Record], reps: int, root: Path) -> dict[str, float]:
    samples: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        samples.setdefault(name, []).append(value)

    add("check_s", _timed(lambda: [check_json(r.state, episode=r.key) for r in records])[0])
    for rep in range(reps):
        base = root / f"{mix}-{rep}"
        _one_rep(rep, records, base, add)
        shutil.rmtree(base)
        cur = {k: round(v[-1], 3) for k, v in samples.items() if k != "check_s"}
        print(f"[{mix} {rep + 1}/{reps}] {cur}", file=sys.stderr, flush=True)
    return {k: float(statistics.median(v)) for k, v in samples.items()}


def _ratios(r: dict[str, float]) -> dict[str, float]:
    return {
        "commit_ratio": r["commit_s"] / r["raw_write_s"],
        "restore_ratio": r["restore_s"] / r["raw_read_decode_s"],
        "vs_peer_commit": r["commit_s"] / r["peer_commit_s"],
        "vs_peer_restore": r["restore_s"] / r["peer_restore_s"],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--kb", type=int, default=50)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="ray-ckpt-bench-", dir="/tmp"))
    mixes: dict[str, dict[str, float]] = {}
    try:
        for mix in ("text", "numbers"):
            print(f"building {args.sessions} x {args.kb} KB {mix} states", file=sys.stderr)
            records = build(mix, args.sessions, args.kb)
            state_mb = sum(len(json.dumps(r.state)) for r in records) / 1e6
            result = run_mix(mix, records, max(3, args.reps), root)
            del records
            mixes[mix] = {"state_mb": state_mb, **result, **_ratios(result)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    keys = (
        "commit_s",
        "restore_s",
        "raw_write_s",
        "raw_read_s",
        "raw_read_decode_s",
        "peer_commit_s",
        "peer_restore_s",
        "check_s",
        "state_mb",
    )
    total = {k: sum(m[k] for m in mixes.values()) for k in keys}
    out: dict[str, Any] = {"sessions": args.sessions, "kb": args.kb, **total, **_ratios(total)}
    out["commit_rss_mb"] = max(m["commit_rss_mb"] for m in mixes.values())
    out["restore_rss_mb"] = max(m["restore_rss_mb"] for m in mixes.values())
    out["mixes"] = mixes
    if args.json:
        print(json.dumps(_round(out)))
        return
    cols = (
        "state_mb",
        "records_mb",
        "commit_s",
        "peer_commit_s",
        "raw_write_s",
        "restore_s",
        "peer_restore_s",
        "raw_read_s",
        "raw_read_decode_s",
        "check_s",
        "commit_rss_mb",
        "restore_rss_mb",
        "peer_restore_rss_mb",
        "commit_ratio",
        "restore_ratio",
        "vs_peer_commit",
        "vs_peer_restore",
    )
    print(f"{args.sessions} sessions x {args.kb} KB (medians of {max(3, args.reps)})")
    print(f"{'':20}" + "".join(f"{m:>12}" for m in mixes))
    for c in cols:
        print(f"{c:20}" + "".join(f"{mixes[m][c]:>12.3f}" for m in mixes))


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    main()
