"""The storage benchmark (issue: benchmarks/storage.py): its promised `--json` figures
at toy size on disk and on a local S3 endpoint, and its refusal of beaten floors."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[3] / "benchmarks"
BENCH = BENCHMARKS / "storage.py"
PROMISED = (
    "sessions",
    "kb",
    "commit_s",
    "restore_s",
    "raw_write_s",
    "raw_read_s",
    "raw_read_decode_s",
    "commit_ratio",
    "restore_ratio",
    "peer_commit_s",
    "peer_restore_s",
    "vs_peer_commit",
    "vs_peer_restore",
    "commit_rss_mb",
    "restore_rss_mb",
    "incremental_bytes_ratio",
    "incremental_commit_ratio",
    "chain_restore_ratio",
)
S3_ONLY = ("s3_commit_s", "s3_restore_s", "s3_commit_ratio")
# The top level is a contract: the keys it always had, plus exactly the new ones.
TOP_LEVEL = {
    *PROMISED,
    "check_s",
    "state_mb",
    "mixes",
    "warnings",
    "goals",
    # The chain's ranged reads fetched bare, over the full file read whole.
    "raw_chain_over_raw_read",
}


def _run(*extra: str) -> dict[str, Any]:
    # --allow-beaten-floor: at toy size a raw write of a few KB is all noise.
    run = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--sessions",
            "3",
            "--kb",
            "2",
            "--json",
            "--allow-beaten-floor",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    out: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def _check_figures(out: dict[str, Any], keys: tuple[str, ...]) -> None:
    assert set(out) == TOP_LEVEL | set(keys)
    assert (out["sessions"], out["kb"]) == (3, 2)
    for key in keys:
        assert isinstance(out[key], int | float), key
        assert out[key] >= 0, key
    # Text-heavy and number-heavy states are reported separately.
    assert set(out["mixes"]) == {"text", "numbers"}
    for mix in out["mixes"].values():
        for key in keys[2:]:
            if not key.startswith("s3_"):
                assert isinstance(mix[key], int | float), key
    # Every beaten floor is named, and every goal says what it measured.
    assert isinstance(out["warnings"], list)
    invalid = {w["figure"] for w in out["warnings"]}
    for name, goal in out["goals"].items():
        assert goal["valid"] == (name not in invalid)
        assert goal["met"] == (goal["valid"] and goal["value"] <= goal["goal"])


def test_on_disk_every_promised_figure_and_no_s3_figures(tmp_path: pathlib.Path) -> None:
    out = _run("--location", str(tmp_path))
    _check_figures(out, PROMISED)
    assert not any(k in out for k in S3_ONLY)
    # The same bytes written through the page cache, for comparison: per mix, on disk.
    for mix in out["mixes"].values():
        assert mix["raw_write_buffered_s"] > 0
        assert mix["raw_write_plain_s"] > 0
        assert mix["raw_chain_read_s"] > 0
        assert mix["raw_chain_over_raw_read"] > 0  # (rounded inputs: not recomputed here)
    assert set(out["goals"]) == {
        "mixes.text.commit_ratio",
        "incremental_bytes_ratio",
        "incremental_commit_ratio",
        "chain_restore_ratio",
    }
    # One episode of three changed: about a third of the bytes of a full commit.
    assert 0.2 < out["incremental_bytes_ratio"] < 0.6
    assert list(tmp_path.iterdir()) == []  # its folder in the location is removed


def test_on_local_s3_adds_the_s3_figures() -> None:
    out = _run("--local-s3")
    _check_figures(out, PROMISED + S3_ONLY)
    for buffered in ("raw_write_buffered_s", "raw_write_plain_s"):
        assert not any(buffered in mix for mix in out["mixes"].values())
    assert out["s3_commit_ratio"] == pytest.approx(out["s3_commit_s"] / out["raw_write_s"], 0.01)
    assert out["goals"]["s3_commit_ratio"]["goal"] == 1.5


@pytest.mark.parametrize("location", ["relative/dir", "ftp://host/x"])
def test_a_location_it_cannot_use_is_refused_naming_it(location: str) -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH), "--sessions", "1", "--kb", "1", "--location", location],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert location in run.stderr
    assert "Traceback" not in run.stderr
    assert run.stdout == ""


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import storage  # type: ignore[import-not-found]

    return storage


def _result(commit_s: float, raw_write_s: float) -> dict[str, Any]:
    mix = {
        "commit_s": commit_s,
        "raw_write_s": raw_write_s,
        "restore_s": 2.0,
        "raw_read_decode_s": 1.0,
        "commit_ratio": commit_s / raw_write_s,
        "restore_ratio": 2.0,
    }
    return {**mix, "mixes": {"text": dict(mix), "numbers": dict(mix)}}


def test_a_beaten_floor_is_named_and_never_passes_a_goal(bench: Any) -> None:
    from storage_report import beaten_floors, goals  # type: ignore[import-not-found]

    out = _result(commit_s=0.5, raw_write_s=1.0)
    warned = {w["figure"] for w in beaten_floors(out)}
    assert warned == {"commit_ratio", "mixes.text.commit_ratio", "mixes.numbers.commit_ratio"}
    verdict = goals(out, warned)["mixes.text.commit_ratio"]
    assert (verdict["valid"], verdict["met"]) == (False, False)  # 0.5 <= 1.5, but not a ratio
    assert beaten_floors(_result(commit_s=1.2, raw_write_s=1.0)) == []


def test_a_beaten_floor_exits_nonzero_unless_allowed(
    bench: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from storage_report import beaten_floors  # type: ignore[import-not-found]

    out = _result(commit_s=0.5, raw_write_s=1.0)
    out.update(sessions=1, kb=1, warnings=beaten_floors(out), goals={})
    monkeypatch.setattr(bench, "measure", lambda args, location: (out, {}))
    assert bench.main(["--json"]) == bench.BEATEN_FLOOR_EXIT
    assert "beaten floor: commit_ratio" in capsys.readouterr().err
    assert bench.main(["--json", "--allow-beaten-floor"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {w["figure"] for w in last["warnings"]} >= {"commit_ratio"}
