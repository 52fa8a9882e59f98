"""The sandbox benchmark (benchmarks/sandbox.py) at toy size: its promised
`--json` figures exist and are numbers; no timing is asserted."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

BENCH = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "sandbox.py"
PROMISED = (
    "full_snapshot_s",
    "raw_copy_s",
    "incremental_bytes_ratio",
    "capture_pause_ratio",
    "restore_ratio",
)


def test_every_promised_figure_is_a_number(tmp_path: pathlib.Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--files",
            "30",
            "--mb",
            "0.5",
            "--reps",
            "1",
            "--dir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    for key in PROMISED:
        assert isinstance(out[key], int | float), key
        assert out[key] > 0, key
    assert (out["files"], out["mb"], out["reps"]) == (30, 0.5, 1)
    # Three of thirty files changed: about a tenth of the full checkpoint's bytes.
    assert out["incremental_bytes_ratio"] < 0.5
    assert set(out["goals"]) == {"incremental_bytes_ratio", "capture_pause_ratio", "restore_ratio"}
    assert list(tmp_path.iterdir()) == []  # its work folder is removed
