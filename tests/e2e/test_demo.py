"""The main job, in-process on the shared cluster: small, but the real flow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from coordination.demo import DemoOptions, run_demo
from coordination.demo.report import Ui

pytestmark = [pytest.mark.ray]


async def test_demo_continues_every_rollout_and_equals_the_uninterrupted_run(
    namespace: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    opts = DemoOptions(
        address=None,
        namespace=namespace,
        rollouts=3,
        steps=2,
        seed=11,
        checkpoint_dir=str(tmp_path / "ckpt"),
        token_delay_s=0.04,
        step_delay_s=0.1,
        verify_delay_s=0.15,
        stagger_s=0.3,
        timeline=str(tmp_path / "timeline.json"),
    )
    report = await run_demo(opts, Ui())
    summary = report.summary()
    assert summary["equal"] is True, summary
    # Equal alone is not a pass: something was in flight and continued.
    assert summary["ok"] is True, summary["problems"]
    assert summary["episodes_in_flight_at_checkpoint"] > 0
    assert summary["lost"] == [] and summary["different"] == []
    # Nothing finished before the crash is redone; everything else continued.
    # A result whose reply the driver lost is recovered by its receipt.
    assert summary["completion_receipts"] is True
    assert summary["results_recovered_by_receipt"] == summary["replies_lost"]
    assert (
        summary["episodes_finished_before_crash"]
        + summary["results_recovered_by_receipt"]
        + summary["episodes_continued"]
        == 3
    )
    assert summary["episodes_restarted"] == 0
    # The restart bias of the restore: every episode of the scope in a bucket
    # of known progress (the environment's records say its steps), none lost.
    bias = summary["restart_bias"]
    assert sum(r["continued"] + r["restarted"] for r in bias.values()) == (
        summary["episodes_in_flight_at_checkpoint"]
    )
    assert sum(r["lost"] for r in bias.values()) == 0
    assert bias["unknown"] == {"continued": 0, "restarted": 0, "lost": 0}
    # The reference model says the tokens each episode had generated.
    assert sum(t.get("continued", 0) for t in summary["restart_bias_tokens"].values()) > 0
    assert summary["bytes"] > 0 and summary["checkpoint_s"] > 0 and summary["restore_s"] > 0
    assert set(report.per_participant) == {
        "environment/ref-environment",
        "model/ref-model",
        "agent/ref-agent",
        "resources/ref-resources",
    }
    assert (tmp_path / "ckpt" / "gym" / "_manifest.json").exists()
    # --timeline: the checkpoint's trace, every participant a row with its phases.
    import json

    assert summary["timeline"] == str(tmp_path / "timeline.json")
    trace = json.loads((tmp_path / "timeline.json").read_text())
    assert trace["otherData"]["checkpoint_id"] == summary["checkpoint_id"]
    rows = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert set(rows.values()) == {"coordinator", *report.per_participant}
    for tid, row in rows.items():
        if row == "coordinator":
            continue
        names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == tid]
        assert names[:2] == ["prepare", "commit"], (row, names)
        assert {"capture", "write", "release", "resume"} <= set(names), (row, names)
    _same_numbers_as_inspect_and_list(summary, tmp_path)


async def test_demo_with_asynchronous_durability_reports_both_times(
    namespace: str, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    opts = DemoOptions(
        address=None,
        namespace=namespace,
        rollouts=3,
        steps=2,
        seed=12,
        checkpoint_dir=str(tmp_path / "ckpt"),
        token_delay_s=0.04,
        step_delay_s=0.1,
        verify_delay_s=0.15,
        stagger_s=0.3,
        durability="async",
    )
    report = await run_demo(opts, Ui())
    summary = report.summary()
    assert summary["ok"] is True, summary["problems"]
    assert summary["equal"] is True
    assert summary["durability"] == "async"
    assert 0 < summary["resumed_s"] <= summary["durable_s"]
    assert (tmp_path / "ckpt" / "gym" / "_manifest.json").exists()
    _same_numbers_as_inspect_and_list(summary, tmp_path)


def _same_numbers_as_inspect_and_list(summary: dict[str, Any], root: Path) -> None:
    """One number per fact: the demo's checkpoint size and episode count are
    the ones `inspect` and `list` give for its directory (sync and async)."""
    from coordination.cli.inspect import inspect_checkpoint
    from coordination.engine.roots import list_root

    inspected = inspect_checkpoint(str(root / "ckpt"))
    listed = {e.name: e for e in list_root(str(root))}["ckpt"]
    assert summary["bytes"] == inspected.bytes == listed.bytes > 0
    assert summary["checkpoint_episodes"] == inspected.episodes == listed.episodes > 0
