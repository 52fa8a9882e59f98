"""The demo shows the tokens of each restart-bias bucket where known (a table
column, `restart_bias_tokens` in its JSON beside the unchanged `restart_bias`),
and `--resume latest` shows the restore's restart bias as the main run does."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from coordination.demo.report import DemoReport, Ui, preempt_table
from coordination.demo.run import finish
from coordination.demo.scenario import Continuation, Rollouts, resume_stopped_run
from coordination.engine.results import RestoreResult
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.root.history import Progress, restart_bias

BIAS = {
    "0": {"continued": 1, "restarted": 0, "lost": 0},
    "3-5": {"continued": 2, "restarted": 1, "lost": 1},
}
TOKENS = {"3-5": {"continued": 30, "lost": 100}}


def rows_of(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines()]


def test_the_table_and_the_json_carry_the_tokens_per_bucket(
    capsys: pytest.CaptureFixture[str],
) -> None:
    r = DemoReport(rollouts=4, steps=5)
    r.add_restore(Continuation(["a", "b", "c"], ["d"], {}, 0.2, [], BIAS, TOKENS))
    finish(r, Ui(stderr=True), as_json=False)
    rows = rows_of(capsys.readouterr().out)
    # The restarted episode's tokens are unknown ("-"), not 0; an outcome
    # with no episodes generated none.
    assert ["3-5", "2", "1", "1", "30 / - / 100"] in rows
    assert ["0", "1", "0", "0", "- / 0 / 0"] in rows
    finish(r, Ui(), as_json=True)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["restart_bias"] == BIAS
    assert summary["restart_bias_tokens"] == TOKENS


class Handle:
    def __init__(self, result: RestoreResult) -> None:
        self.result = result

    async def arestore(self, location: str) -> RestoreResult:
        return self.result


async def test_a_resumed_run_reports_and_shows_its_restart_bias() -> None:
    bias = restart_bias(
        [EpisodeId("r0")],
        ["r0"],
        ["r0", "r1"],
        {"r0": Progress(steps=4, tokens=30), "r1": Progress(steps=12)},
    )
    result = RestoreResult(
        checkpoint_id="restore-1",
        source_checkpoint_id="ckpt-1",
        checkpoint_dir="/ckpt/step-1",
        total_s=0.1,
        timings={},
        restored={},
        resumed=True,
        restart_bias=bias,
    )
    rollouts = Rollouts.make(2, 3, 0)
    # Every rollout had finished: nothing is started again (no fleet needed).
    state = SimpleNamespace(results={r: {} for r in rollouts.tasks}, attempts={})
    session: Any = None
    cont = await resume_stopped_run(Handle(result), session, "", "/ckpt/step-1", state, rollouts)
    assert cont.restart_bias == bias.as_table()
    assert cont.restart_bias_tokens == {"3-5": {"continued": 30}}

    summary = {
        "resumed_from": cont.checkpoint_dir,
        "restart_bias": cont.restart_bias,
        "restart_bias_tokens": cont.restart_bias_tokens,
        "ok": True,
    }
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(preempt_table(summary))
    text = out.getvalue()
    assert "ray-ckpt demo (resume)" in text
    assert "restart bias" in text
    rows = rows_of(text)
    assert ["3-5", "1", "0", "0", "30 / 0 / 0"] in rows
    assert ["11+", "0", "0", "1", "0 / 0 / -"] in rows
