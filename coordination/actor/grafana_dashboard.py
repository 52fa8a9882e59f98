"""The Grafana dashboard of ray-ckpt's Prometheus metrics, built in Python.

`ray-ckpt grafana-dashboard > dashboard.json` prints `dashboard()`.  It is
shaped as Ray's own dashboards are (`ray/dashboard/modules/metrics/dashboards`
in the installed ray): `graph` panels two to a row under `row` panels, every
query on the `${datasource}` Prometheus data source and filtered by the
`SessionName` and `Cluster` (`ray_io_cluster`, set per cluster by KubeRay's
PodMonitor) variables, so it sits beside Ray's dashboards in one Grafana.
Two variables of its own narrow the panels to some triggers and kinds.

The queries name the metrics as Ray's endpoint exports them: `ray_` before
the registered `ckpt_` names (`ray_ckpt.hosting.metrics.EXPORTED_PREFIX`),
`_bucket`/`_count` for histograms, `_total` for counters.
`tests/ray/test_grafana_dashboard.py` scrapes a real endpoint after a
checkpoint, a restore and a refused restore, and checks that every metric a
query names was exported with every label the query uses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata
from typing import Any

UID = "rayCkptDashboard"
TITLE = "ray-ckpt: checkpoints of Gym servers"
# Ray's own filters (its default dashboard's), then ours.
_GLOBAL = 'SessionName=~"$SessionName",ray_io_cluster=~"$Cluster"'
_TRIGGER = 'trigger=~"$Trigger"'
_KIND = 'kind=~"$Kind"'
_NOT_CONTINUED = 'outcome!="continued"'
# The variables' values are read off a metric every fleet exports: each host
# observes its control calls (status included).
_ANCHOR = "ray_ckpt_control_call_seconds_count"
_PANEL_H, _PANEL_W = 8, 12


def _sel(*extra: str) -> str:
    return "{" + ",".join((_GLOBAL, *extra)) + "}"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]
    stack: bool = False


def _quantiles(metric: str, by: str, what: str, *extra: str) -> tuple[Target, ...]:
    """p50 and p95 of a histogram, by `by`."""
    rate = f"rate({metric}_bucket{_sel(*extra)}[$__rate_interval])"
    legend = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(","))
    return tuple(
        Target(f"histogram_quantile({q}, sum by (le, {by}) ({rate}))", f"{what} p{p}: {legend}")
        for q, p in ((0.5, 50), (0.95, 95))
    )


def _increase(metric: str, by: str, legend: str, *extra: str) -> Target:
    return Target(f"sum by ({by}) (increase({metric}{_sel(*extra)}[$__rate_interval]))", legend)


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Checkpoints",
        (
            Panel(
                "Checkpoints by trigger and outcome",
                "Checkpoints finished (ok), failed or called off (aborted), by what started "
                "them: manual, periodic, signal or drain.",
                "short",
                (
                    _increase(
                        "ray_ckpt_checkpoints_total",
                        "trigger, outcome",
                        "{{trigger}} {{outcome}}",
                        _TRIGGER,
                    ),
                ),
                stack=True,
            ),
            Panel(
                "Checkpoint duration by trigger",
                "Whole checkpoint, from the prepare to the resume (or to publish-ready when "
                "kept open). Quantiles from Ray's histogram buckets (5 ms to 300 s).",
                "s",
                _quantiles(
                    "ray_ckpt_total_save_seconds", "trigger", "total", _TRIGGER, 'outcome="ok"'
                ),
            ),
            Panel(
                "Pause by trigger",
                "How long the Gym servers were paused: admission closed from the prepare "
                "until the resume reopened it, and the part of it spent waiting for every "
                "participant to reach its boundaries (the barrier).",
                "s",
                (
                    *_quantiles("ray_ckpt_exclusive_hold_seconds", "trigger", "paused", _TRIGGER),
                    *_quantiles("ray_ckpt_barrier_wait_seconds", "trigger", "barrier", _TRIGGER),
                ),
            ),
            Panel(
                "Publishing and resume by trigger",
                "Publishing the Gym manifest (and LATEST when kept open; for an asynchronous "
                "checkpoint, from the resume until both are durable), and resuming every "
                "participant.",
                "s",
                (
                    *_quantiles("ray_ckpt_durable_seconds", "trigger", "durable", _TRIGGER),
                    *_quantiles("ray_ckpt_resume_seconds", "trigger", "resume", _TRIGGER),
                ),
            ),
            Panel(
                "Prepare and commit by participant",
                "Each participant kind's prepare call (its own wait for boundaries) and commit "
                "call (the write of its records), as the coordinator measured them.",
                "s",
                (
                    *_quantiles("ray_ckpt_prepare_wait_seconds", "kind", "prepare", _KIND),
                    *_quantiles("ray_ckpt_commit_seconds", "kind", "commit", _KIND),
                ),
            ),
            Panel(
                "Control calls by participant and operation (p95)",
                "Every control call as each host served it, by operation; failed calls apart.",
                "s",
                (
                    Target(
                        "histogram_quantile(0.95, sum by (le, kind, op, outcome) "
                        f"(rate(ray_ckpt_control_call_seconds_bucket{_sel(_KIND)}"
                        "[$__rate_interval])))",
                        "{{kind}} {{op}} {{outcome}}",
                    ),
                ),
            ),
            Panel(
                "Failures by phase and code",
                "One per failing participant and error code (e.g. deadline_exceeded, "
                "not_fresh), under the phase that failed.",
                "short",
                (_increase("ray_ckpt_failures_total", "phase, code", "{{phase}} {{code}}"),),
                stack=True,
            ),
            Panel(
                "Episodes in checkpoints",
                "Episodes in the scope of checkpoints, and of those the ones a participant "
                "held state for (continue) and the ones none did (start over).",
                "short",
                (
                    _increase(
                        "ray_ckpt_episodes_in_scope_total",
                        "trigger",
                        "in scope {{trigger}}",
                        _TRIGGER,
                    ),
                    _increase(
                        "ray_ckpt_episodes_continued_total",
                        "phase",
                        "continued ({{phase}})",
                        'phase="checkpoint"',
                    ),
                    _increase(
                        "ray_ckpt_episodes_restarted_total",
                        "phase",
                        "restarted ({{phase}})",
                        'phase="checkpoint"',
                    ),
                ),
            ),
        ),
    ),
    (
        "Bytes",
        (
            Panel(
                "Bytes written by participant",
                "Records written by checkpoints, per second, by participant kind (an "
                "incremental checkpoint writes only what changed).",
                "Bps",
                (
                    Target(
                        "sum by (kind) (rate(ray_ckpt_bytes_written_total"
                        f"{_sel(_KIND)}[$__rate_interval]))",
                        "{{kind}}",
                    ),
                ),
                stack=True,
            ),
            Panel(
                "Last checkpoint size by trigger",
                "Bytes the last complete checkpoint wrote (an asynchronous one once durable), "
                "held until the next one: Ray drops a gauge not set again within two report "
                "intervals, so the panel looks back an hour for the latest value.",
                "bytes",
                (
                    Target(
                        "max by (trigger) (last_over_time(ray_ckpt_last_checkpoint_bytes"
                        f"{_sel(_TRIGGER)}[1h]))",
                        "{{trigger}}",
                    ),
                ),
            ),
            Panel(
                "Writes in flight by participant",
                "Commit writes under way (an asynchronous commit's outlives its checkpoint's "
                "resume; the next prepare waits for it).",
                "short",
                (
                    Target(
                        "sum by (kind) (max_over_time(ray_ckpt_writes_in_flight"
                        f"{_sel(_KIND)}[$__rate_interval]))",
                        "{{kind}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "Held results",
        (
            Panel(
                "Results held for acknowledgement",
                "Finished results the environment servers hold until the trainer acknowledges "
                "them (completion receipts); they go into every checkpoint meanwhile.",
                "short",
                (
                    Target(
                        f"sum by (kind) (ray_ckpt_unacknowledged_results{_sel(_KIND)})",
                        "{{kind}}",
                    ),
                ),
            ),
            Panel(
                "Bytes held for acknowledgement",
                "The held results' bytes.",
                "bytes",
                (
                    Target(
                        f"sum by (kind) (ray_ckpt_unacknowledged_bytes{_sel(_KIND)})",
                        "{{kind}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "Restores and restart bias",
        (
            Panel(
                "Restores by outcome",
                "Restores finished (ok) or refused/failed, and their duration.",
                "short",
                (_increase("ray_ckpt_restore_seconds_count", "outcome", "{{outcome}}"),),
                stack=True,
            ),
            Panel(
                "Restore duration",
                "Whole restore: the checks, every participant's install, the resume.",
                "s",
                _quantiles("ray_ckpt_restore_seconds", "outcome", "restore"),
            ),
            Panel(
                "Restart bias: episodes by progress and outcome",
                "Each restore's episodes by outcome (continued, restarted from scratch, or "
                "lost: checkpointed but not asked for) and by how far each had got (bucket: "
                "steps done). Resuming is unbiased when the buckets' shares match.",
                "short",
                (
                    _increase(
                        "ray_ckpt_restore_episodes_total",
                        "bucket, outcome",
                        "{{outcome}} {{bucket}}",
                    ),
                ),
                stack=True,
            ),
            Panel(
                "Restart bias: share not continued, by progress",
                "Over the dashboard's time range, the share of each bucket's episodes that "
                "were restarted or lost. A share that grows with the bucket is the bias "
                "NeMo RL's users saw (long episodes lost more often).",
                "percentunit",
                (
                    Target(
                        "sum by (bucket) (increase(ray_ckpt_restore_episodes_total"
                        f"{_sel(_NOT_CONTINUED)}"
                        "[$__range])) / sum by (bucket) (increase("
                        f"ray_ckpt_restore_episodes_total{_sel()}[$__range]))",
                        "{{bucket}}",
                    ),
                ),
            ),
        ),
    ),
)


def _graph(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    """A `graph` panel as Ray's dashboards have it (Grafana schema 27)."""
    return {
        "aliasColors": {},
        "bars": False,
        "dashLength": 10,
        "dashes": False,
        "datasource": "${datasource}",
        "description": panel.description,
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "fill": 10 if panel.stack else 0,
        "fillGradient": 0,
        "gridPos": {"h": _PANEL_H, "w": _PANEL_W, "x": x, "y": y},
        "hiddenSeries": False,
        "id": panel_id,
        "legend": {
            "alignAsTable": True,
            "avg": False,
            "current": True,
            "hideEmpty": False,
            "hideZero": True,
            "max": True,
            "min": False,
            "rightSide": False,
            "show": True,
            "sort": "current",
            "sortDesc": True,
            "total": False,
            "values": True,
        },
        "lines": True,
        "linewidth": 1,
        "nullPointMode": "null",
        "options": {"alertThreshold": True},
        "percentage": False,
        "pointradius": 2,
        "points": False,
        "renderer": "flot",
        "seriesOverrides": [],
        "spaceLength": 10,
        "stack": panel.stack,
        "steppedLine": False,
        "targets": [
            {
                "exemplar": True,
                "expr": t.expr,
                "interval": "",
                "legendFormat": t.legend,
                "refId": chr(ord("A") + i),
            }
            for i, t in enumerate(panel.targets)
        ],
        "thresholds": [],
        "timeFrom": None,
        "timeRegions": [],
        "timeShift": None,
        "title": panel.title,
        "tooltip": {"shared": True, "sort": 0, "value_type": "individual"},
        "type": "graph",
        "xaxis": {"buckets": None, "mode": "time", "name": None, "show": True, "values": []},
        "yaxes": [
            {
                "format": panel.unit,
                "label": "",
                "logBase": 1,
                "max": None,
                "min": "0",
                "show": True,
            },
            {
                "format": "short",
                "label": None,
                "logBase": 1,
                "max": None,
                "min": None,
                "show": True,
            },
        ],
        "yaxis": {"align": False, "alignLevel": None},
    }


def _query_variable(name: str, label: str, metric: str, description: str) -> dict[str, Any]:
    query = f"label_values({metric}, {label})"
    return {
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "datasource": "${datasource}",
        "definition": query,
        "description": description,
        "hide": 0,
        "includeAll": True,
        "multi": True,
        "name": name,
        "options": [],
        "query": {"query": query, "refId": "StandardVariableQuery"},
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
        "sort": 2,
        "type": "query",
    }


def _templating() -> dict[str, Any]:
    session = f'{_ANCHOR}{{SessionName=~"$SessionName"}}'
    return {
        "list": [
            {
                "current": {"selected": False},
                "description": "Filter queries of a specific Prometheus type.",
                "hide": 2,
                "includeAll": False,
                "multi": False,
                "name": "datasource",
                "options": [],
                "query": "prometheus",
                "refresh": 1,
                "regex": "",
                "skipUrlSync": False,
                "type": "datasource",
            },
            _query_variable(
                "SessionName", "SessionName", _ANCHOR, "Filter queries to specific Ray sessions."
            ),
            _query_variable(
                "Cluster",
                "ray_io_cluster",
                _ANCHOR,
                "Filter queries to specific Ray clusters (the ray_io_cluster label, set per "
                "cluster by KubeRay's PodMonitor; absent elsewhere).",
            ),
            _query_variable(
                "Trigger",
                "trigger",
                'ray_ckpt_checkpoints_total{SessionName=~"$SessionName"}',
                "Filter checkpoint panels to some triggers (manual, periodic, signal, drain).",
            ),
            _query_variable(
                "Kind", "kind", session, "Filter participant panels to some participant kinds."
            ),
        ]
    }


def _version() -> str:
    try:
        return metadata.version("ray-ckpt")
    except metadata.PackageNotFoundError:  # run from a source tree never installed
        return "unknown"


def dashboard() -> dict[str, Any]:
    """The whole dashboard, ready for Grafana's import (or its provisioning)."""
    panels: list[dict[str, Any]] = []
    y = 0
    next_id = 1
    for row_index, (title, row) in enumerate(ROWS):
        panels.append(
            {
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "id": 1000 + row_index,
                "panels": [],
                "title": title,
                "type": "row",
            }
        )
        y += 1
        for i, panel in enumerate(row):
            x = _PANEL_W * (i % 2)
            panels.append(_graph(panel, next_id, x, y + _PANEL_H * (i // 2)))
            next_id += 1
        y += _PANEL_H * ((len(row) + 1) // 2)
    return {
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": "-- Grafana --",
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "editable": True,
        "gnetId": None,
        "graphTooltip": 1,
        "links": [],
        "panels": panels,
        "refresh": False,
        "schemaVersion": 27,
        "style": "dark",
        "tags": ["ray-ckpt", f"ray-ckpt:{_version()}"],
        "templating": _templating(),
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": TITLE,
        "uid": UID,
        "version": 1,
    }


_METRIC = re.compile(r"\bray_ckpt_[a-z_]+\b")


def queries(board: dict[str, Any]) -> list[str]:
    """Every PromQL query of `board`: the panels' targets and the variables'."""
    out = [t["expr"] for p in board["panels"] for t in p.get("targets", ())]
    out += [v["query"]["query"] for v in board["templating"]["list"] if "definition" in v]
    return out


def metric_names(query: str) -> set[str]:
    """The ray-ckpt metrics a query reads (as exported: `_bucket`, `_total`...)."""
    return set(_METRIC.findall(query))
