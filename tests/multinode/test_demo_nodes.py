"""The main job across nodes, as a user runs it: `python -m coordination.demo
--nodes 3 --kill-node --json` starts its own local 3-node cluster, spreads the
fleet, loses the node of the environment and agent hosts after the
checkpoint, restores on the survivors and finishes equal to the
uninterrupted run; `--json` carries `nodes`, `node_killed` and `placement`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_demo_loses_a_node_and_restores_on_the_survivors(tmp_path: Path) -> None:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_ADDRESS": ""}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "coordination.demo",
            *("--nodes", "3", "--kill-node", "--rollouts", "4", "--steps", "3", "--json"),
            *("--checkpoint-dir", str(tmp_path / "ckpt")),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["ok"] is True, out["problems"]
    assert out["equal"] is True
    assert out["nodes"] == 3
    before, after = out["placement"]["before"], out["placement"]["after"]
    assert set(before) == set(after) == {"environment", "agent", "model", "resources"}
    killed = out["node_killed"]
    assert before["environment"] == before["agent"] == killed
    assert before["model"] == before["resources"] != killed
    # The lost hosts came back on a surviving node; the others where they were.
    assert after["environment"] == after["agent"] != killed
    assert after["model"] == before["model"]
    assert out["episodes_continued"] > 0
    assert "placement on 3 nodes" in run.stdout  # the table a person reads
