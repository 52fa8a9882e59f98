"""The storage benchmark's states (a text-heavy and a number-heavy mix) and its RSS probe.

Text-heavy states look like tool outputs (nested dicts, long strings with
non-ASCII and escapes); number-heavy ones like token ids and logprobs (with
NaN, inf and -0.0).  `changed` makes the next generation of a mix with a
fraction of its episodes changed, for the incremental figures.
"""

from __future__ import annotations

import math
import random
import threading
from typing import Any

import psutil

from ray_ckpt.storage.records.record import Record

MIXES = ("text", "numbers")


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
        return [Record(f"r{i}", text_state(i, kb, pool), version="0") for i in range(sessions)]
    n = kb * 1024 // 26
    floats = [rng.uniform(-25.0, 0.0) for _ in range(n + 20000)]
    ids = [rng.randrange(0, 152000) for _ in range(n + 20000)]
    return [Record(f"r{i}", number_state(i, kb, floats, ids), version="0") for i in range(sessions)]


def changed(records: list[Record], fraction: float, generation: int) -> list[Record]:
    """Generation `generation`: the same episodes, `fraction` of them (at least
    one, spread over the list, the same ones in every generation: those still
    stepping) with a new step and a new version (the exporter's step count)."""
    count = max(1, round(len(records) * fraction))
    stride = len(records) / count
    picked = {int(k * stride) for k in range(count)}
    out = []
    for i, rec in enumerate(records):
        if i in picked:
            # A step taken: the state grows by one small entry, the rest is shared.
            step = {"generation": generation, "reward": (generation * 0.37) % 1 - 0.5}
            rec = Record(rec.key, {**rec.state, "last_step": step}, version=str(generation))
        out.append(rec)
    return out


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
