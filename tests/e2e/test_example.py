"""examples/training_loop.py, run as a user would, attached to the shared cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "training_loop.py"


def test_training_loop_example_checkpoints_with_the_trainer_paused(ray_session: str) -> None:
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
    lines = out.stdout.strip().splitlines()
    assert sum("episodes in flight" in line for line in lines) == 2, out.stdout
    history = lines[-1].removeprefix("trainer saw: ").split(", ")
    # Paused from prepare to resume, once per checkpoint, in order.
    assert [h.split()[0] for h in history] == ["pause", "resume", "pause", "resume"]
    assert history[0].split()[1] == history[1].split()[1] != history[2].split()[1]
