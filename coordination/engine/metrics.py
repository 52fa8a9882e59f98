"""The coordinator's checkpoint metrics, exported through Ray's Prometheus endpoint.

Names follow NeMo RL's rollout-checkpoint timings where they mean the same
(`total_save_seconds`, `barrier_wait_seconds`, `exclusive_hold_seconds`),
under a `ray_ckpt_` prefix.  Labels are low-cardinality only — `kind`,
`phase`, `outcome`, `trigger`, `code` — never a rollout or checkpoint ID, so
a run of days keeps a fixed number of series.

`CoordinatorMetrics` turns results into observations on a `MetricSink`:
`RaySink` (`ray.util.metrics`, created lazily inside the actor), or
`NullSink` (the core's default, off Ray: costs one method call) or a
recording sink in unit tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from coordination.engine.baseline import Trigger
from coordination.engine.results import (
    CheckpointResult,
    DurableResult,
    RestoreResult,
)
from ray_ckpt.errors import CheckpointError, CoordinationFailed

# What started a checkpoint (the `trigger` label).
TRIGGERS = tuple(t.value for t in Trigger)


# name (without the prefix) → (type, description, label keys)
DEFINITIONS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "total_save_seconds": (
        "histogram",
        "Whole checkpoint, prepare to resume (or to publish-ready when kept open)",
        ("trigger", "outcome"),
    ),
    "barrier_wait_seconds": (
        "histogram",
        "Prepare: waiting for every participant to reach its boundaries",
        ("trigger",),
    ),
    "prepare_wait_seconds": (
        "histogram",
        "One participant's prepare call (its wait for its own boundaries)",
        ("kind",),
    ),
    "exclusive_hold_seconds": (
        "histogram",
        "Admission closed: from the prepare until the resume reopened it",
        ("trigger",),
    ),
    "commit_seconds": (
        "histogram",
        "One participant's commit call (its write of its records)",
        ("kind",),
    ),
    "durable_seconds": (
        "histogram",
        # A resuming checkpoint writes LATEST beside the resume, outside this
        # time; an asynchronous one reports its resume-to-durable time.
        "Publishing: the Gym manifest (the commit point), and LATEST if kept open; "
        "async: from the resume to the Gym manifest and LATEST",
        ("trigger",),
    ),
    "resume_seconds": ("histogram", "Resume of every participant", ("trigger",)),
    "restore_seconds": ("histogram", "Whole restore", ("outcome",)),
    "checkpoints_total": ("counter", "Checkpoints by trigger and outcome", ("trigger", "outcome")),
    "bytes_written_total": ("counter", "Bytes of records written by checkpoints", ("kind",)),
    "last_checkpoint_bytes": ("gauge", "Bytes the last complete checkpoint wrote", ("trigger",)),
    "episodes_in_scope_total": ("counter", "Episodes in the scope of checkpoints", ("trigger",)),
    "episodes_continued_total": (
        "counter",
        "Episodes a checkpoint or restore holds state for (continue)",
        ("phase",),
    ),
    "episodes_restarted_total": (
        "counter",
        "Episodes of a scope no participant held state for (start over)",
        ("phase",),
    ),
    # The restart bias of each restore: its episodes by outcome
    # (continued | restarted | lost) and by how far each had got (`bucket`:
    # steps done, `ray_ckpt.storage.root.history.BUCKETS`); scraped as the
    # family `ray_ckpt_restore_episodes`.
    "restore_episodes": (
        "counter",
        "Episodes of restores by outcome and by steps done before the checkpoint",
        ("outcome", "bucket"),
    ),
    "failures_total": (
        "counter",
        "Failed operations by phase and error code (one per failing participant)",
        ("phase", "code"),
    ),
}


class MetricSink(Protocol):
    def record(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        """Observe (histogram), add (counter) or set (gauge) `name`."""


class NullSink:
    def record(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        return None


def kind_of(key: str) -> str:
    """The participant kind of a member key `<kind>/<name>`."""
    return key.partition("/")[0]


def trigger_label(trigger: str) -> str:
    return trigger if trigger in TRIGGERS else "manual"


class CoordinatorMetrics:
    def __init__(self, sink: MetricSink | None = None) -> None:
        self.sink: MetricSink = sink or NullSink()

    def checkpoint_done(self, result: CheckpointResult, trigger: str) -> None:
        t = {"trigger": trigger_label(trigger)}
        rec = self.sink.record
        rec("total_save_seconds", result.total_s, {**t, "outcome": "ok"})
        rec("checkpoints_total", 1, {**t, "outcome": "ok"})
        rec("barrier_wait_seconds", result.prepare_s, t)
        if not result.pending:  # an asynchronous one reports at `durable_done`
            rec("durable_seconds", result.manifest_s, t)
        if result.resume_s is not None:
            rec("resume_seconds", result.resume_s, t)
            # `total_s` runs from the prepare (after the lock) to the end of the
            # resume: the time admission was closed.
            rec("exclusive_hold_seconds", result.total_s, t)
        for key, table in result.timings.items():
            if "prepare" in table:
                rec("prepare_wait_seconds", table["prepare"], {"kind": kind_of(key)})
            if "commit" in table:
                rec("commit_seconds", table["commit"], {"kind": kind_of(key)})
        by_kind: dict[str, int] = {}
        for key, n in result.bytes.items():
            if n is not None:  # None: a pending checkpoint's, not written yet
                by_kind[kind_of(key)] = by_kind.get(kind_of(key), 0) + n
        if not result.pending:
            for kind, n in by_kind.items():
                rec("bytes_written_total", n, {"kind": kind})
        if result.total_bytes is not None:  # a pending one's: at `durable_done`
            rec("last_checkpoint_bytes", result.total_bytes, t)
        rec("episodes_in_scope_total", len(result.continued) + len(result.restart), t)
        rec("episodes_continued_total", len(result.continued), {"phase": "checkpoint"})
        rec("episodes_restarted_total", len(result.restart), {"phase": "checkpoint"})

    def durable_done(self, result: DurableResult, trigger: str = "manual") -> None:
        """An asynchronous checkpoint published: its resume-to-durable time."""
        t = {"trigger": trigger}
        self.sink.record("durable_seconds", result.durable_s, t)
        by_kind: dict[str, int] = {}
        for key, n in result.bytes.items():
            by_kind[kind_of(key)] = by_kind.get(kind_of(key), 0) + n
        for kind, n in by_kind.items():
            self.sink.record("bytes_written_total", n, {"kind": kind})
        self.sink.record("last_checkpoint_bytes", result.total_bytes, t)

    def checkpoint_failed(self, err: BaseException, seconds: float, trigger: str) -> None:
        t = {"trigger": trigger_label(trigger)}
        self.sink.record("total_save_seconds", seconds, {**t, "outcome": "failed"})
        self.sink.record("checkpoints_total", 1, {**t, "outcome": "failed"})
        self.failed("checkpoint", err)

    def checkpoint_aborted(self, seconds: float, trigger: str) -> None:
        """Opened and called off (resumed before any commit) by its caller."""
        t = {"trigger": trigger_label(trigger)}
        self.sink.record("total_save_seconds", seconds, {**t, "outcome": "aborted"})
        self.sink.record("checkpoints_total", 1, {**t, "outcome": "aborted"})

    def restore_done(self, result: RestoreResult) -> None:
        self.sink.record("restore_seconds", result.total_s, {"outcome": "ok"})
        self.sink.record("episodes_continued_total", len(result.continued), {"phase": "restore"})
        self.sink.record("episodes_restarted_total", len(result.restart), {"phase": "restore"})
        if result.restart_bias is not None:
            for row in result.restart_bias.rows:
                for outcome in ("continued", "restarted", "lost"):
                    self.sink.record(
                        "restore_episodes",
                        getattr(row, outcome),
                        {"outcome": outcome, "bucket": row.bucket},
                    )

    def restore_failed(self, err: BaseException, seconds: float) -> None:
        self.sink.record("restore_seconds", seconds, {"outcome": "failed"})
        self.failed("restore", err)

    def failed(self, operation: str, err: BaseException) -> None:
        """One count per failing participant and code, under the phase that
        failed (a `CoordinationFailed` names it), else one for the error."""
        if isinstance(err, CoordinationFailed) and err.failures:
            phase = err.operation or operation
            for entry in err.failures.values():
                code = str(entry.get("code") or "unknown")
                self.sink.record("failures_total", 1, {"phase": phase, "code": code})
            return
        code = err.code if isinstance(err, CheckpointError) else "internal"
        self.sink.record("failures_total", 1, {"phase": operation, "code": code})
