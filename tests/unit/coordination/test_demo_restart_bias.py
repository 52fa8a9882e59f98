"""The demo shows the restore's restart bias: a table, and `restart_bias` in
its JSON (per bucket, continued / restarted / lost)."""

from __future__ import annotations

import json

import pytest

from coordination.demo.report import DemoReport, Ui
from coordination.demo.run import finish
from coordination.demo.scenario import Continuation

BIAS = {
    "0": {"continued": 1, "restarted": 0, "lost": 0},
    "3-5": {"continued": 2, "restarted": 1, "lost": 1},
}


def test_the_table_and_the_json_carry_the_restart_bias(
    capsys: pytest.CaptureFixture[str],
) -> None:
    r = DemoReport(rollouts=4, steps=5)
    r.add_restore(Continuation(["a", "b", "c"], ["d"], {}, 0.2, [], BIAS))
    finish(r, Ui(stderr=True), as_json=False)
    table = capsys.readouterr().out
    assert "restart bias" in table
    rows = [[c.strip() for c in line.split("│")[1:5]] for line in table.splitlines()]
    assert ["3-5", "2", "1", "1"] in rows
    finish(r, Ui(), as_json=True)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["restart_bias"] == BIAS
