"""The coordination benchmark's `--simulated` figures (issue: scale past this
machine, by simulation), at toy size, without Ray: the promised `--json` keys,
and a cycle whose every fake host committed."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "coordination.py"


def test_simulated_json_carries_the_promised_figures() -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH), "--simulated", "40", "--scaling", "8,40", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["runs"] == []  # no --participants: no Ray started
    sim = out["simulated"]
    assert set(sim) == {"participants", "cycle_s", "coordinator_us_per_participant"}
    assert sim["participants"] == 40
    assert sim["cycle_s"] > 0
    assert 0 <= sim["coordinator_us_per_participant"] < sim["cycle_s"] * 1e6 / 40 + 1e-9
    assert [r["participants"] for r in out["simulated_scaling"]] == [8, 40]
    assert out["simulated_growth"] > 0
    assert "coordinator us/participant" in run.stderr  # the table a person reads
