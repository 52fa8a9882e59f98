"""The demo's verdict: equal results are not enough to pass (no Ray)."""

from __future__ import annotations

import json

import pytest

from coordination.demo.report import DemoReport, Ui
from coordination.demo.run import finish
from coordination.demo.scenario import Continuation
from coordination.engine.results import CommitResult, PrepareResult


def report(*, scope: list[str], continued: list[str], equal: bool = True) -> DemoReport:
    r = DemoReport(rollouts=3, steps=2)
    prepared = PrepareResult(checkpoint_id="c", seconds=0.1, timings={}, restarts={})
    committed = CommitResult(
        checkpoint_id="c",
        checkpoint_dir="/ck",
        seconds=0.2,
        manifest_s=0.01,
        timings={},
        bytes={},
        episode_ids={},
        continued=scope,
        restart=[],
    )
    r.add_checkpoint(prepared, committed)
    restarted = [k for k in scope if k not in continued]
    r.add_restore(Continuation(continued, restarted, {}, 0.3))
    r.equal = equal  # what `compare` found
    return r


def verdict(r: DemoReport, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, object]]:
    code = finish(r, Ui(), as_json=True)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    return code, json.loads(last)


def test_a_demo_that_continued_episodes_and_equals_the_run_passes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, summary = verdict(report(scope=["r1", "r2"], continued=["r1", "r2"]), capsys)
    assert code == 0
    assert summary["ok"] is True
    assert summary["problems"] == []
    assert summary["episodes_in_flight_at_checkpoint"] == 2


def test_nothing_in_flight_at_the_checkpoint_fails_even_if_equal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, summary = verdict(report(scope=[], continued=[]), capsys)
    assert code == 1
    assert summary["equal"] is True
    assert summary["ok"] is False
    assert "nothing was in flight at the checkpoint" in summary["problems"]  # type: ignore[operator]


def test_no_episode_continued_fails_even_if_equal(capsys: pytest.CaptureFixture[str]) -> None:
    code, summary = verdict(report(scope=["r1"], continued=[]), capsys)
    assert code == 1
    assert summary["equal"] is True
    assert summary["problems"] == ["no episode was continued from the checkpoint"]


def test_results_that_differ_fail(capsys: pytest.CaptureFixture[str]) -> None:
    code, summary = verdict(report(scope=["r1"], continued=["r1"], equal=False), capsys)
    assert code == 1
    assert summary["ok"] is False


def test_results_recovered_by_receipt_are_counted_and_a_missing_one_fails(
    capsys: pytest.CaptureFixture[str],
) -> None:
    r = report(scope=["r1", "r2"], continued=["r1", "r2"])
    r.completion_receipts, r.replies_lost = True, 1
    r.add_restore(Continuation(["r1", "r2"], [], {}, 0.3, recovered=["r0"]))
    code, summary = verdict(r, capsys)
    assert (code, summary["replies_lost"], summary["results_recovered_by_receipt"]) == (0, 1, 1)
    r.replies_lost = 2  # one lost reply's result never came back
    code, summary = verdict(r, capsys)
    assert code == 1
    assert "a lost reply's result was not recovered by receipt" in summary["problems"]  # type: ignore[operator]


def test_replies_are_lost_only_where_most_rollouts_stay_in_flight() -> None:
    """A quarter of the rollouts at most, none below four (with 3 rollouts of one
    length the demo waited for a finish and then had nothing in flight)."""
    from types import SimpleNamespace
    from typing import Any

    from coordination.demo.run import lost_replies_wanted

    def opts(rollouts: int, receipts: bool = True) -> Any:
        return SimpleNamespace(rollouts=rollouts, receipts=receipts, lose_replies=2)

    assert lost_replies_wanted(opts(3)) == 0
    assert lost_replies_wanted(opts(8)) == 2
    assert lost_replies_wanted(opts(8, receipts=False)) == 0
