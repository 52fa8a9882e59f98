"""The coordinator's metrics as Ray metrics (`ray.util.metrics`), inside the actor.

`coordination.engine.metrics` defines every metric and what a checkpoint records,
with a sink of its own choosing; off Ray it records nothing.  The actor gives
it this one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coordination.engine.metrics import DEFINITIONS, MetricSink, NullSink
from ray_ckpt.hosting.metrics import PREFIX, SECONDS_BOUNDARIES, KeptGauges


class RaySink:
    """`ray.util.metrics` objects, one per name, made on first use (inside a
    Ray worker: the driver's import of this module registers nothing)."""

    def __init__(self) -> None:
        self._metrics: dict[str, Any] = {}
        self._gauges = KeptGauges()  # the last checkpoint's size stays exported

    def _metric(self, name: str) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            from ray.util import metrics

            kind, description, keys = DEFINITIONS[name]
            full = PREFIX + name
            if kind == "histogram":
                metric = metrics.Histogram(
                    full, description, boundaries=SECONDS_BOUNDARIES, tag_keys=keys
                )
            elif kind == "counter":
                metric = metrics.Counter(full, description, tag_keys=keys)
            else:
                metric = metrics.Gauge(full, description, tag_keys=keys)
            self._metrics[name] = metric
        return metric

    def record(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        metric = self._metric(name)
        kind = DEFINITIONS[name][0]
        if kind == "histogram":
            metric.observe(value, tags=dict(tags))
        elif kind == "counter":
            if value > 0:
                metric.inc(value, tags=dict(tags))
        else:
            self._gauges.set(metric, value, dict(tags))


def ray_sink() -> MetricSink:
    """Ray's metrics inside a Ray worker, else none (a coordinator built off Ray)."""
    import ray

    return RaySink() if ray.is_initialized() else NullSink()
