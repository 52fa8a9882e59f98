"""The storage benchmark's promised `--json` line (issue: benchmarks/storage.py), at toy size."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "storage.py"
PROMISED = (
    "sessions",
    "kb",
    "commit_s",
    "restore_s",
    "raw_write_s",
    "raw_read_decode_s",
    "commit_ratio",
    "restore_ratio",
    "peer_commit_s",
    "peer_restore_s",
    "vs_peer_commit",
    "vs_peer_restore",
    "commit_rss_mb",
    "restore_rss_mb",
)


def test_json_line_carries_every_promised_figure_for_both_mixes() -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH), "--sessions", "3", "--kb", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert (out["sessions"], out["kb"]) == (3, 2)
    for key in PROMISED:
        assert isinstance(out[key], int | float), key
        assert out[key] >= 0, key
    # Text-heavy and number-heavy states are reported separately.
    assert set(out["mixes"]) == {"text", "numbers"}
    for mix in out["mixes"].values():
        for key in PROMISED[2:]:
            assert isinstance(mix[key], int | float), key
