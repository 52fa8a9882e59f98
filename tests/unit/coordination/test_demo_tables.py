"""The demo's tables say what its JSON says (no Ray: the report objects)."""

from __future__ import annotations

import io

from rich.console import Console

from coordination.demo.report import DemoReport, Ui, distinct_episodes, preempt_table
from coordination.engine.results import CommitResult, PrepareResult


def _render(table: object) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(table)
    return out.getvalue()


def test_a_resumed_run_prints_its_table_with_the_jsons_facts() -> None:
    summary = {
        "resumed_from": "/ckpt/step-3",
        "resumed_checkpoint_id": "ckpt-3",
        "episodes_finished_before": 2,
        "episodes_continued": 5,
        "episodes_restarted": 1,
        "finished": 8,
        "lost": [],
        "equal": True,
        "ok": True,
    }
    text = _render(preempt_table(summary))
    assert "ray-ckpt demo (resume)" in text
    for label, value in (
        ("resumed from", "/ckpt/step-3"),
        ("episodes continued", "5"),
        ("episodes restarted", "1"),
        ("equal to uninterrupted run", "yes"),
    ):
        line = next(row for row in text.splitlines() if label in row)
        assert line.rstrip(" │").endswith(value), line


def test_the_demo_table_counts_episodes_as_its_json() -> None:
    """In flight at the checkpoint is the scope (the JSON's count), not the
    /stats sample taken before it; a checkpoint's episodes leave held results out."""
    report = DemoReport(rollouts=8, steps=4)
    report.in_flight = {"generating": 3, "tool_calls": 2, "verifying": 1, "episodes": 7}
    prepared = PrepareResult(checkpoint_id="c1", seconds=0.1, timings={}, restarts={})
    keys = {"environment/e": ["r0", "r1", "result:r2"], "model/m": ["r0", "r1"]}
    committed = CommitResult(
        checkpoint_id="c1",
        checkpoint_dir="/ckpt/c1",
        seconds=0.2,
        manifest_s=0.0,
        timings={"environment/e": 0.1, "model/m": 0.1},
        bytes={"environment/e": 2048, "model/m": 1024},
        episode_ids=keys,
        continued=[f"r{i}" for i in range(7)],
        restart=["r7"],
    )
    report.add_checkpoint(prepared, committed)
    summary = report.summary()
    assert summary["episodes_in_flight_at_checkpoint"] == 8
    assert summary["checkpoint_episodes"] == distinct_episodes(keys) == 2
    ui = Ui()
    ui.out = Console(file=io.StringIO(), width=200, color_system=None)
    ui.print_report(report)
    text = ui.out.file.getvalue()  # type: ignore[attr-defined]
    line = next(row for row in text.splitlines() if "episodes in flight at checkpoint" in row)
    assert line.rstrip(" │").endswith("8"), line
    assert "3.0 KiB" in text  # the one byte formatter
