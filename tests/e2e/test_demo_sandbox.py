"""`ray-ckpt demo --sandbox --json`, run as a user runs it (its own Ray).

Coding episodes checkpointed mid-flight, the host killed, a fresh one
restored; every episode's files and reward equal an uninterrupted run's,
the episode whose background process was live at the checkpoint restarted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray]


def test_demo_sandbox_continues_episodes_and_restarts_the_live_one(tmp_path: Path) -> None:
    ray_ckpt = str(Path(sys.executable).with_name("ray-ckpt"))
    ckpt = tmp_path / "ckpt"
    args = ["--rollouts", "4", "--steps", "3", "--stagger", "0.15", "--step-delay", "0.1"]
    proc = subprocess.run(
        [ray_ckpt, "demo", "--sandbox", "--json", "--checkpoint-dir", str(ckpt), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    # The demo's usual keys, and the sandbox's own.
    assert {
        "ok",
        "equal",
        "episodes_in_flight_at_checkpoint",
        "episodes_continued",
        "episodes_restarted",
        "lost",
        "different",
        "checkpoint_id",
        "bytes",
        "sandbox_bytes",
        "restarted_live",
    } <= set(summary)
    assert summary["ok"] is True, summary["problems"]
    assert summary["equal"] is True
    assert summary["lost"] == []
    assert summary["different"] == []
    assert summary["episodes_continued"] >= 1
    assert summary["restarted_live"] == ["r0"]
    assert summary["episodes_restarted"] >= 1
    assert 0 < summary["sandbox_bytes"] <= summary["bytes"]
    assert len(set(summary["rewards"].values())) > 1
    assert summary["sandboxes_left"] == 0
    # The sandbox files are in the checkpoint, one blob per content.
    blobs = list(ckpt.glob("gym/environment/*/blobs/*"))
    assert blobs
    assert sum(b.stat().st_size for b in blobs) == summary["sandbox_bytes"]
    table = "\n".join(lines[:-1])
    for label in ("episodes continued", "restarted: a process was live", "sandbox files"):
        assert label in table
