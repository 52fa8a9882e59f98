"""A host's metrics, exported through Ray's Prometheus endpoint.

Per Gym server host: how long each control call took (`op`, `outcome`), the
commit writes in flight, the lease expiries (a coordinator that went
silent) and, with completion receipts, the finished results (and bytes) held
for the trainer's acknowledgement.  Labels are the participant kind, the operation and the outcome
only — never a rollout, checkpoint or instance name — so the number of
series stays fixed however long the run.
"""

from __future__ import annotations

import threading
import time
from typing import Any

# Ray's Prometheus exporter puts its namespace, `ray_`, before every metric
# name: registered as `ckpt_<name>`, each is scraped as `ray_ckpt_<name>`.
PREFIX = "ckpt_"
EXPORTED_PREFIX = "ray_" + PREFIX
# Seconds: from a few milliseconds (an idle fleet on loopback) to the
# default commit deadline (300 s).
SECONDS_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]


# Ray's exporter drops a gauge's series that was not set again for a while
# (measured: 12-20 s with 2 s report intervals): a Gym that stays quiet would
# then show no checkpoint size and no writes in flight at all.  So every
# gauge is set again at this period, well inside the shortest interval in use
# (the tests' 2 s); a few `set` calls a second cost nothing measurable.
KEEP_EVERY_S = 1.0


class KeptGauges:
    """Gauges whose last values are set again every `every_s` by one daemon
    thread (started at the first `set`), so Ray keeps exporting them."""

    def __init__(self, every_s: float = KEEP_EVERY_S) -> None:
        self._every_s = every_s
        self._last: dict[tuple[int, tuple[tuple[str, str], ...]], tuple[Any, float]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def set(self, gauge: Any, value: float, tags: dict[str, str]) -> None:
        gauge.set(value, tags=tags)
        with self._lock:
            self._last[(id(gauge), tuple(sorted(tags.items())))] = (gauge, value)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._keep, name="ray-ckpt-gauges", daemon=True
                )
                self._thread.start()

    def _keep(self) -> None:
        while True:
            time.sleep(self._every_s)
            with self._lock:
                kept = [(g, v, dict(t)) for (_, t), (g, v) in self._last.items()]
            for gauge, value, tags in kept:
                gauge.set(value, tags=tags)


class HostMetrics:
    """A `ControlObserver` over `ray.util.metrics` (made inside the host actor)."""

    def __init__(self, kind: str) -> None:
        from ray.util import metrics

        self._tags = {"kind": kind}
        self._gauges = KeptGauges()
        self._calls: Any = metrics.Histogram(
            PREFIX + "control_call_seconds",
            "One control call on a participant, by operation and outcome",
            boundaries=SECONDS_BOUNDARIES,
            tag_keys=("kind", "op", "outcome"),
        )
        self._writes: Any = metrics.Gauge(
            PREFIX + "writes_in_flight",
            "Commit writes under way on a participant",
            tag_keys=("kind",),
        )
        self._held: Any = metrics.Gauge(
            PREFIX + "unacknowledged_results",
            "Finished results held for the trainer's acknowledgement (completion receipts)",
            tag_keys=("kind",),
        )
        self._held_bytes: Any = metrics.Gauge(
            PREFIX + "unacknowledged_bytes",
            "Bytes of the finished results held for acknowledgement",
            tag_keys=("kind",),
        )
        self._expiries: Any = metrics.Counter(
            PREFIX + "lease_expiries_total",
            "Leases that ran out (the participant resumed by itself)",
            tag_keys=("kind",),
        )

    def call_done(self, op: str, seconds: float, outcome: str, writes_in_flight: int) -> None:
        self._calls.observe(seconds, tags={**self._tags, "op": op, "outcome": outcome})
        self._gauges.set(self._writes, writes_in_flight, self._tags)

    def lease_expired(self) -> None:
        self._expiries.inc(1, tags=self._tags)

    def held(self, results: int, size: int) -> None:
        self._gauges.set(self._held, results, self._tags)
        self._gauges.set(self._held_bytes, size, self._tags)
