"""What the main job measured, and how it shows it (progress bars, tables, JSON)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from coordination.cli.output import format_bytes
from coordination.demo.scenario import Continuation, Rollouts
from coordination.engine.results import (
    CheckpointResult,
    CommitResult,
    DurableResult,
    PrepareResult,
)
from participants.rollout import result_digest
from ray_ckpt.identity import is_result_key


@dataclass
class DemoReport:
    rollouts: int
    steps: int
    in_flight: dict[str, int] = field(default_factory=dict)
    # Episodes unfinished when the checkpoint was taken (its scope).
    in_scope: int = 0
    # The checkpoint's episodes as `inspect`, `list` and `status` count them:
    # distinct capture keys any participant wrote (held results not counted).
    checkpoint_episodes: int = 0
    finished_before_crash: int = 0
    checkpoint_id: str = ""
    prepare_s: float = 0.0
    commit_s: float = 0.0
    per_participant: dict[str, dict[str, Any]] = field(default_factory=dict)
    restore_s: float = 0.0
    continued: list[str] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)
    # {steps bucket: {continued, restarted, lost}}: does resuming bias the data?
    restart_bias: dict[str, dict[str, int]] = field(default_factory=dict)
    # {steps bucket: {outcome: tokens generated}}, where a participant said.
    restart_bias_tokens: dict[str, dict[str, int]] = field(default_factory=dict)
    equal: bool = False
    lost: list[str] = field(default_factory=list)
    different: list[str] = field(default_factory=list)
    tokens_baseline: int = 0
    tokens_generated: int = 0
    tokens_continued: int = 0
    model_counts: dict[str, int] = field(default_factory=dict)
    nodes: int = 1
    node_killed: str | None = None
    # kind -> node ID, "before" the crash and "after" the restore
    placement: dict[str, dict[str, str]] = field(default_factory=dict)
    timeline: str | None = None  # the checkpoint's Chrome trace, with --timeline FILE
    durability: str = "sync"
    resumed_s: float | None = None  # async: from the call to the Gym resumed
    durable_s: float | None = None  # async: from the call to the Gym manifest written
    completion_receipts: bool = False
    replies_lost: int = 0  # results whose reply the driver lost before the checkpoint
    results_recovered_by_receipt: int = 0  # ... and got back by `collect()` after the restore
    workers: int = 1  # worker processes per Gym server
    restore_workers: int = 1  # ... in the fresh fleet the restore went to
    # kind -> worker processes whose /stats answered at the checkpoint
    workers_serving: dict[str, int] = field(default_factory=dict)
    # --partition: the node cut off, the cut to Ray declaring it dead, the
    # open checkpoint's commit during the cut, and the zombie's late calls
    # after the heal (what it tried, what refused them; by kind and by code).
    partitioned_node: str | None = None
    detected_s: float | None = None
    commit_during_cut: str | None = None
    zombie_tried: dict[str, int] = field(default_factory=dict)
    zombie_refused_by: dict[str, int] = field(default_factory=dict)

    @property
    def zombie_attempts(self) -> int:
        return sum(self.zombie_tried.values())

    @property
    def zombie_refused(self) -> int:
        return sum(self.zombie_refused_by.values())

    def add_checkpoint(self, prepared: PrepareResult, committed: CommitResult) -> None:
        self.checkpoint_id = committed.checkpoint_id
        self.prepare_s = prepared.seconds
        self.commit_s = committed.seconds
        self.in_scope = len(committed.continued) + len(committed.restart)
        self.checkpoint_episodes = distinct_episodes(committed.episode_ids)
        for name in sorted(set(prepared.timings) | set(committed.timings)):
            self.per_participant[name] = {
                "prepare_s": prepared.timings.get(name, 0.0),
                "commit_s": committed.timings.get(name, 0.0),
                "bytes": committed.bytes.get(name, 0),
                "episodes": len(committed.episode_ids.get(name, [])),
            }

    def add_async_checkpoint(self, result: CheckpointResult, done: DurableResult) -> None:
        self.durability = "async"
        self.checkpoint_id = result.checkpoint_id
        self.prepare_s = result.prepare_s
        self.commit_s = result.commit_s  # the capture; the write ran after the resume
        self.in_scope = len(result.continued) + len(result.restart)
        self.checkpoint_episodes = distinct_episodes(result.episode_ids)
        for name in sorted(result.timings):
            self.per_participant[name] = {
                "prepare_s": result.timings[name].get("prepare", 0.0),
                "commit_s": result.timings[name].get("commit", 0.0),
                "bytes": done.bytes.get(name, 0),
                "episodes": len(result.episode_ids.get(name, [])),
            }

    def add_restore(self, cont: Continuation) -> None:
        self.restore_s = cont.restore_s
        self.continued = sorted(cont.continued)
        self.restarted = sorted(cont.restarted)
        self.restart_bias = cont.restart_bias
        self.restart_bias_tokens = cont.restart_bias_tokens
        self.results_recovered_by_receipt = len(cont.recovered)

    def compare(
        self,
        expected: dict[str, str],
        rollouts: Rollouts,
        *,
        base: dict[str, dict[str, Any]],
        before: dict[str, dict[str, Any]],
        after: dict[str, dict[str, Any]],
    ) -> None:
        self.lost = sorted(r for r in rollouts.tasks if r not in rollouts.results)
        self.different = sorted(
            r for r, res in rollouts.results.items() if result_digest(res) != expected.get(r)
        )
        self.equal = not self.lost and not self.different and len(expected) == self.rollouts
        self.tokens_baseline = int(base.get("model", {}).get("tokens_generated", 0))
        self.tokens_generated = sum(
            int(s.get("model", {}).get("tokens_generated", 0)) for s in (before, after)
        )
        self.tokens_continued = int(after.get("model", {}).get("tokens_continued", 0))
        for stats in (before, after):
            for k, v in (stats.get("model", {}).get("counts") or {}).items():
                self.model_counts[k] = self.model_counts.get(k, 0) + int(v)

    @property
    def bytes(self) -> int:
        return sum(int(p["bytes"]) for p in self.per_participant.values())

    def problems(self) -> list[str]:
        """Why the run proves nothing or failed; empty when it passed.  Equal
        results alone are not enough: with nothing in flight at the checkpoint,
        or nothing continued from it, no checkpoint was put to the test."""
        out: list[str] = []
        if not self.equal:
            out.append("results differ from the uninterrupted run (or were lost)")
        if self.in_scope == 0:
            out.append("nothing was in flight at the checkpoint")
        if not self.continued:
            out.append("no episode was continued from the checkpoint")
        if self.completion_receipts and self.results_recovered_by_receipt < self.replies_lost:
            out.append("a lost reply's result was not recovered by receipt")
        if self.partitioned_node is not None:
            if self.zombie_attempts == 0:
                out.append("the zombie tried nothing after the heal (nothing was fenced)")
            elif self.zombie_refused < self.zombie_attempts:
                out.append("a late call of the zombie was not refused")
            if self.commit_during_cut == "ok":
                out.append("the checkpoint open at the cut completed without the cut node")
        return out

    @property
    def ok(self) -> bool:
        """The exit status: 0 only if this is true."""
        return not self.problems()

    def summary(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": self.problems(),
            "rollouts": self.rollouts,
            "steps": self.steps,
            "equal": self.equal,
            "episodes_in_flight_at_checkpoint": self.in_scope,
            "episodes_finished_before_crash": self.finished_before_crash,
            "episodes_continued": len(self.continued),
            "episodes_restarted": len(self.restarted),
            "restart_bias": self.restart_bias,
            "restart_bias_tokens": self.restart_bias_tokens,
            "lost": self.lost,
            "different": self.different,
            "checkpoint_id": self.checkpoint_id,
            "checkpoint_s": round(self.prepare_s + self.commit_s, 4),
            "prepare_s": round(self.prepare_s, 4),
            "commit_s": round(self.commit_s, 4),
            "restore_s": round(self.restore_s, 4),
            "bytes": self.bytes,
            "checkpoint_episodes": self.checkpoint_episodes,
            "in_flight_at_checkpoint": self.in_flight,
            "tokens_regenerated": max(self.tokens_generated - self.tokens_baseline, 0),
            "tokens_continued_from_cuts": self.tokens_continued,
            "generation_cuts": self.model_counts,
            "participants": self.per_participant,
            "nodes": self.nodes,
            "node_killed": self.node_killed,
            "placement": self.placement,
            "timeline": self.timeline,
            "durability": self.durability,
            "resumed_s": None if self.resumed_s is None else round(self.resumed_s, 4),
            "durable_s": None if self.durable_s is None else round(self.durable_s, 4),
            "completion_receipts": self.completion_receipts,
            "replies_lost": self.replies_lost,
            "results_recovered_by_receipt": self.results_recovered_by_receipt,
            "workers": self.workers,
            "workers_serving": self.workers_serving,
            "restore_workers": self.restore_workers,
            **(self.partition_summary() if self.partitioned_node is not None else {}),
        }

    def partition_summary(self) -> dict[str, Any]:
        return {
            "partitioned_node": self.partitioned_node,
            "detected_s": None if self.detected_s is None else round(self.detected_s, 3),
            "commit_during_cut": self.commit_during_cut,
            "zombie_attempts": self.zombie_attempts,
            "zombie_refused": self.zombie_refused,
            "zombie_tried": self.zombie_tried,
            "zombie_refused_by": self.zombie_refused_by,
        }


def distinct_episodes(episode_ids: dict[str, list[str]]) -> int:
    """Distinct capture keys over every participant, held results left out:
    how `inspect`, `list` and `status` count a checkpoint's episodes."""
    return len({k for keys in episode_ids.values() for k in keys if not is_result_key(k)})


class Ui:
    """Progress bars on stderr while the job runs; tables on stdout at the end."""

    def __init__(self, *, stderr: bool = True) -> None:
        self.progress_console = Console(stderr=stderr)
        self.out = Console()

    @contextlib.contextmanager
    def phase(self, name: str, total: int | None) -> Iterator[Callable[[], None]]:
        columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn()]
        columns += [TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn()]
        with Progress(*columns, console=self.progress_console, transient=False) as progress:
            task = progress.add_task(name, total=total)

            def advance() -> None:
                progress.advance(task)

            yield advance
            if total is None:
                progress.update(task, total=1, completed=1)

    def print_report(self, r: DemoReport) -> None:
        s = r.summary()
        run = Table(title="ray-ckpt demo", show_header=False)
        run.add_column("what")
        run.add_column("value", justify="right")
        for label, value in (
            ("rollouts x steps", f"{r.rollouts} x {r.steps}"),
            # The JSON's episodes_in_flight_at_checkpoint: the scope, counted
            # at the checkpoint (the states below were sampled just before).
            ("episodes in flight at checkpoint", str(r.in_scope)),
            (
                "work seen before it",
                ", ".join(f"{k} {v}" for k, v in r.in_flight.items() if k != "episodes") or "-",
            ),
            ("episodes in the checkpoint", str(r.checkpoint_episodes)),
            ("finished before the crash", str(r.finished_before_crash)),
            ("episodes continued", str(len(r.continued))),
            ("episodes restarted", str(len(r.restarted))),
            (
                "replies lost / recovered by receipt",
                f"{r.replies_lost} / {r.results_recovered_by_receipt}"
                if r.completion_receipts
                else "receipts off",
            ),
            ("checkpoint (prepare + commit)", f"{s['checkpoint_s']:.3f} s"),
            *(
                [
                    ("async: resumed after", f"{r.resumed_s:.3f} s"),
                    ("async: durable after", f"{r.durable_s:.3f} s"),
                ]
                if r.resumed_s is not None and r.durable_s is not None
                else []
            ),
            ("restore", f"{r.restore_s:.3f} s"),
            ("checkpoint size", format_bytes(r.bytes)),
            ("tokens regenerated after crash", str(s["tokens_regenerated"])),
            ("tokens continued from cuts", str(r.tokens_continued)),
            ("lost", ", ".join(r.lost) or "none"),
            ("equal to uninterrupted run", "yes" if r.equal else "NO"),
            ("timeline (chrome://tracing, Perfetto)", r.timeline or "-"),
            *(partition_rows(r) if r.partitioned_node is not None else []),
            ("passed", "yes" if r.ok else "NO: " + "; ".join(r.problems())),
        ):
            run.add_row(label, value)
        parts = Table(title="per participant")
        for col in ("participant", "prepare s", "commit s", "bytes", "episodes"):
            parts.add_column(col, justify="left" if col == "participant" else "right")
        for name, p in r.per_participant.items():
            parts.add_row(
                name,
                f"{p['prepare_s']:.3f}",
                f"{p['commit_s']:.3f}",
                format_bytes(int(p["bytes"])),
                str(p["episodes"]),
            )
        self.out.print(run)
        self.out.print(parts)
        if r.restart_bias:
            self.out.print(bias_table(r.restart_bias, r.restart_bias_tokens))
        if r.nodes > 1:
            self.out.print(placement_table(r))


def partition_rows(r: DemoReport) -> list[tuple[str, str]]:
    """--partition: the cut, its detection, and the zombie fenced."""

    def by(counts: dict[str, int]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"

    return [
        ("partitioned node", str(r.partitioned_node)),
        ("cut -> declared dead", "-" if r.detected_s is None else f"{r.detected_s:.2f} s"),
        ("checkpoint open at the cut", r.commit_during_cut or "-"),
        ("zombie tried after the heal", f"{r.zombie_attempts} ({by(r.zombie_tried)})"),
        ("zombie refused", f"{r.zombie_refused} ({by(r.zombie_refused_by)})"),
    ]


OUTCOMES = ("continued", "restarted", "lost")


def bias_table(
    bias: dict[str, dict[str, int]], tokens: dict[str, dict[str, int]] | None = None
) -> Table:
    """The restore's episodes by steps done before the checkpoint and outcome;
    with `tokens` known anywhere, a last column: the tokens those episodes had
    generated, per outcome ("-": episodes none of whose participants said)."""
    table = Table(title="restart bias (by steps done at the checkpoint)")
    for col in ("steps done", *OUTCOMES):
        table.add_column(col, justify="left" if col == "steps done" else "right")
    if tokens:
        table.add_column("tokens " + " / ".join(OUTCOMES), justify="right")
    for bucket, row in bias.items():
        cells = [str(row.get(o, 0)) for o in OUTCOMES]
        if tokens:
            said = tokens.get(bucket, {})
            cells.append(" / ".join(_tokens_cell(row, said, o) for o in OUTCOMES))
        table.add_row(bucket, *cells)
    return table


def _tokens_cell(row: dict[str, int], said: dict[str, int], outcome: str) -> str:
    if outcome in said:
        return str(said[outcome])
    return "0" if not row.get(outcome, 0) else "-"  # no episodes: nothing generated


# The facts of a `--until-signal` / `--resume latest` run, labelled as the
# main run's table labels them (its JSON keys on the right).
PREEMPT_ROWS = (
    ("resumed from", "resumed_from"),
    ("resumed checkpoint", "resumed_checkpoint_id"),
    ("finished before the stop", "episodes_finished_before"),
    ("episodes continued", "episodes_continued"),
    ("episodes restarted", "episodes_restarted"),
    ("stopped by", "stopped_by"),
    ("checkpoint", "checkpoint_id"),
    ("checkpoint directory", "checkpoint_dir"),
    ("episodes in flight at the stop", "episodes_in_flight"),
    ("finished", "finished"),
    ("lost", "lost"),
    ("equal to uninterrupted run", "equal"),
    ("error", "error"),
    ("passed", "ok"),
)


def preempt_table(summary: dict[str, Any]) -> RenderableType:
    """`--until-signal` and `--resume latest`: the run's table (their JSON's
    facts), and a resumed run's restart bias below it, as the main run shows it."""
    table = Table(
        title="ray-ckpt demo (" + ("resume" if "resumed_from" in summary else "signals") + ")",
        show_header=False,
    )
    table.add_column("what")
    table.add_column("value", justify="right")
    for label, key in PREEMPT_ROWS:
        if key not in summary:
            continue
        value = summary[key]
        if isinstance(value, bool):
            text = "yes" if value else "NO"
        elif isinstance(value, list):
            text = ", ".join(map(str, value)) or "none"
        elif isinstance(value, dict):
            text = str(value.get("detail", value))
        else:
            text = "-" if value is None else str(value)
        table.add_row(label, text)
    bias = summary.get("restart_bias")
    if bias:
        return Group(table, bias_table(bias, summary.get("restart_bias_tokens")))
    return table


def placement_table(r: DemoReport) -> Table:
    """kind -> node (short IDs), before the crash and after the restore."""
    table = Table(title=f"placement on {r.nodes} nodes")
    for col in ("host", "before", "after"):
        table.add_column(col)
    before, after = r.placement.get("before", {}), r.placement.get("after", {})
    for kind in sorted(before):
        was, now = before[kind], after.get(kind, "")
        lost = " (lost)" if was == r.node_killed else ""
        table.add_row(kind, was[:12] + lost, now[:12])
    return table
