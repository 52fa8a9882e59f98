"""The coordination benchmark against real host actors on the session's
cluster, at its smallest size: every promised figure, derived as its name
says, from cycles that really wrote checkpoints (not how fast: that is the
benchmark's own business)."""

from __future__ import annotations

import math
import pathlib

import pytest

from ray_ckpt.storage import read_gym_manifest

KEYS = {
    "participants",
    "cycle_s",
    "rtt_s",
    "fanout_s",
    "floor_s",
    "cycle_over_floor",
    "cycle_over_fanout",
    "actor_floor_s",
    "cycle_over_actor_floor",
    "participants_direct_s",
    "coordinator_own_s",
    "driver_direct_s",
    "participants_over_floor",
    "cycle_over_participants",
}


def test_one_run_reports_every_figure_from_real_checkpoints(
    ray_session: str, tmp_path: pathlib.Path
) -> None:
    from benchmarks.coordination import run_one

    row = run_one(4, 1, str(tmp_path))
    assert set(row) == KEYS
    assert row["participants"] == 4
    for key in KEYS - {"participants", "coordinator_own_s"}:
        assert row[key] > 0, key
    assert row["cycle_over_floor"] == pytest.approx(row["cycle_s"] / row["floor_s"])
    assert row["cycle_over_fanout"] == pytest.approx(row["cycle_s"] / (9 * row["fanout_s"]))
    assert row["participants_over_floor"] == pytest.approx(row["driver_direct_s"] / row["floor_s"])
    assert row["cycle_over_participants"] == pytest.approx(row["cycle_s"] / row["driver_direct_s"])
    assert math.isclose(row["coordinator_own_s"], row["cycle_s"] - row["participants_direct_s"])
    # The warm-up cycle and the measured one each wrote a complete checkpoint
    # of all four hosts, one per kind.
    for tag in ("warm", "0"):
        gym = read_gym_manifest(tmp_path / f"ck-4-{tag}")
        assert sorted(e.kind for e in gym.participants) == [
            "agent",
            "environment",
            "model",
            "resources",
        ]
