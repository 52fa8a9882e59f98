"""`ray-ckpt demo --sandbox` without Ray: its usage errors, its tasks, its verdict.

The run itself is tests/e2e/test_demo_sandbox.py; here, what it refuses
before anything starts, and when its report passes: equal files and
rewards, an episode continued, and the background one restarted because
its process was live.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordination.cli.output import ExitCode
from coordination.demo import run, sandbox
from coordination.demo.sandbox import (
    BACKGROUND_EXTRA_STEPS,
    MAX_STEPS,
    Outcome,
    SandboxReport,
    blob_bytes,
    sandbox_tasks,
)
from coordination.demo.scenario import Rollouts


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    started: list[object] = []
    monkeypatch.setattr(sandbox, "run_sandbox_demo", lambda *a, **k: started.append(a))
    monkeypatch.setattr(run, "start_ray", lambda *a, **k: started.append(a))
    return started


@pytest.mark.parametrize(
    "args",
    [
        ["--sandbox", "--nodes", "2"],
        ["--sandbox", "--nodes", "3", "--partition"],
        ["--sandbox", "--until-signal", "--checkpoint-dir", "/tmp/x"],
        ["--sandbox", "--durability", "async"],
        ["--sandbox", "--workers", "2"],
        ["--sandbox", "--timeline", "/tmp/t.json"],
        ["--sandbox", "--checkpoint-dir", "s3://bucket/x"],
        ["--sandbox", "--steps", str(MAX_STEPS + 1)],
    ],
)
def test_sandbox_usage_errors_start_nothing(
    args: list[str], nothing_starts: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run.demo_command_main(args) == ExitCode.BAD_INPUT
    assert nothing_starts == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "--sandbox" in err[0]


def test_one_task_starts_a_background_process_and_runs_longer() -> None:
    tasks = sandbox_tasks(4, steps=3, seed=5)
    assert list(tasks) == ["r0", "r1", "r2", "r3"]
    assert [r for r, t in tasks.items() if t.get("background")] == ["r0"]
    assert tasks["r0"]["steps"] == 3 + BACKGROUND_EXTRA_STEPS
    assert {t["steps"] for r, t in tasks.items() if r != "r0"} == {3}
    assert len({t["seed"] for t in tasks.values()}) == 4
    assert sandbox_tasks(4, steps=3, seed=5) == tasks  # the seed decides


def passing() -> tuple[SandboxReport, dict[str, Outcome], Rollouts]:
    tasks = sandbox_tasks(3, steps=2, seed=1)
    rollouts = Rollouts(tasks)
    expected = {}
    for i, rollout in enumerate(tasks):
        expected[rollout] = Outcome(f"d{i}", i / 4)
        rollouts.results[rollout] = {"files_digest": f"d{i}", "reward": i / 4}
    report = SandboxReport(rollouts=3, steps=2)
    report.continued = ["r1", "r2"]
    report.restarted = ["r0"]
    report.restarted_live = ["r0"]
    return report, expected, rollouts


def test_the_report_passes_only_with_equal_results_a_continuation_and_the_live_restart() -> None:
    report, expected, rollouts = passing()
    report.compare(expected, rollouts)
    assert report.ok, report.problems()
    summary = report.summary()
    assert summary["equal"] is True
    assert summary["episodes_continued"] == 2
    assert summary["episodes_restarted"] == 1
    assert summary["restarted_live"] == ["r0"]
    json.dumps(summary)  # one JSON object, as --json prints it

    report, expected, rollouts = passing()
    rollouts.results["r2"] = {"files_digest": "other", "reward": 0.5}
    report.compare(expected, rollouts)
    assert report.different == ["r2"]
    assert not report.ok

    report, expected, rollouts = passing()
    del rollouts.results["r1"]
    report.compare(expected, rollouts)
    assert report.lost == ["r1"]
    assert not report.ok

    report, expected, rollouts = passing()
    report.continued = []
    report.compare(expected, rollouts)
    assert report.problems() == ["no episode was continued from the checkpoint"]

    report, expected, rollouts = passing()
    report.restarted, report.continued = [], ["r0", "r1", "r2"]
    report.compare(expected, rollouts)
    assert report.problems() == ["the background episode r0 was not restarted"]

    report, expected, rollouts = passing()
    report.restarted_live = []
    report.compare(expected, rollouts)
    assert report.problems() == ["r0 was not reported as restarted for a live process"]


def test_sandbox_bytes_are_the_blobs_of_the_checkpoint(tmp_path: Path) -> None:
    root = tmp_path
    blobs = root / "gym" / "environment" / "ref-coding" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / ("a" * 64)).write_bytes(b"x" * 10)
    (blobs / ("b" * 64)).write_bytes(b"y" * 5)
    (root / "gym" / "environment" / "ref-coding" / "records").write_bytes(b"z" * 100)
    assert blob_bytes(str(root)) == 15


@pytest.mark.parametrize("n", [1, 2, 3, 8, 9])
def test_the_background_rollout_starts_in_the_middle(n: int) -> None:
    """The checkpoint lands once every rollout has begun: the background
    rollout started first had finished its patches by then on an idle
    machine (its process stopped: nothing to restart), so it starts halfway."""
    order = sandbox.start_order(sandbox_tasks(n, 4, 0))
    assert sorted(order) == sorted(f"r{i}" for i in range(n))
    assert order.index(sandbox.BACKGROUND_ROLLOUT) == (n - 1) // 2
