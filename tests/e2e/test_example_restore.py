"""examples/restore_after_crash.py, run as a user would, attached to the shared cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "restore_after_crash.py"


def test_restore_example_continues_every_rollout_in_fresh_servers(ray_session: str) -> None:
    import ray

    address = ray.get_runtime_context().gcs_address
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--address", address, "--rollouts", "4"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    # Every rollout finished, those in flight at the checkpoint in the fresh
    # servers, and each of those continued from the state the checkpoint held.
    assert summary["finished"] == [f"rollout-{i}" for i in range(4)]
    assert summary["in_flight_at_checkpoint"]
    assert summary["continued"] == summary["in_flight_at_checkpoint"]
    assert summary["restarted"] == []
