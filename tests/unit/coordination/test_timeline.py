"""The checkpoint timeline: every participant's phases as ordered slices, the
participant's own capture/write/release inside its commit, the coordinator's
publish, the trigger and outcome, and as a Chrome trace."""

from __future__ import annotations

import json

import pytest

from coordination.engine.timeline import (
    COORDINATOR_ROW,
    KEEP,
    TimelineRecorder,
    chrome_trace,
)
from coordination.reach.hosts import FakePauseTarget
from ray_ckpt.errors import CoordinationFailed, InvalidRequest
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import make_fleet


def by_row(trace: dict[str, object]) -> dict[str, list[dict[str, object]]]:
    events = trace["traceEvents"]
    assert isinstance(events, list)
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    rows: dict[str, list[dict[str, object]]] = {n: [] for n in names.values()}
    for e in events:
        if e["ph"] == "X":
            rows[names[e["tid"]]].append(e)
    return rows


async def test_every_participant_and_phase_is_there_in_order() -> None:
    fleet = make_fleet()
    trainer = FakePauseTarget("trainer")
    fleet.core.register_pause(trainer)
    try:
        fleet.parts["environment/env"].start("r1", at_boundary=True, state={"x": 1})
        result = await fleet.core.checkpoint("/ck", [EpisodeId("r1")], trigger="signal")
        trace = chrome_trace(fleet.core.timeline.get("latest"))
    finally:
        await fleet.aclose()
    json.dumps(trace)  # plain JSON, as the file will be
    info = trace["otherData"]
    assert info["checkpoint_id"] == result.checkpoint_id
    assert (info["trigger"], info["outcome"]) == ("signal", "ok")
    rows = by_row(trace)
    assert set(rows) == {COORDINATOR_ROW, *fleet.parts}
    assert next(iter(rows)) == COORDINATOR_ROW
    for key in fleet.parts:
        names = [e["name"] for e in rows[key]]
        phases = [n for n in names if n in ("prepare", "commit", "resume")]
        assert phases == ["prepare", "commit", "resume"], key
        # The participant's own slices, inside its commit call.
        commit = next(e for e in rows[key] if e["name"] == "commit")
        own = [e for e in rows[key] if e["name"] in ("capture", "write", "release")]
        assert [e["name"] for e in own] == ["capture", "write", "release"], key
        for e in own:
            assert commit["ts"] <= e["ts"]
            assert e["ts"] + e["dur"] <= commit["ts"] + commit["dur"] + 1  # rounding
        ends = [e["ts"] + e["dur"] for e in rows[key] if e["name"] in phases]
        starts = [e["ts"] for e in rows[key] if e["name"] in phases]
        assert all(ends[i] <= starts[i + 1] for i in range(len(starts) - 1)), key
    coordinator = [e["name"] for e in rows[COORDINATOR_ROW]]
    assert coordinator == ["pause callers", "publish", "resume callers"]
    # The Gym manifest is published after the last participant's commit ends.
    publish = next(e for e in rows[COORDINATOR_ROW] if e["name"] == "publish")
    last_commit_end = max(
        e["ts"] + e["dur"] for k in fleet.parts for e in rows[k] if e["name"] == "commit"
    )
    assert publish["ts"] >= last_commit_end - 1


async def test_a_failed_checkpoint_has_its_own_timeline() -> None:
    fleet = make_fleet()
    try:
        for key in fleet.parts:
            fleet.parts[key].start("r1", at_boundary=True, state={"at": key})
        ok = await fleet.core.checkpoint("/ck", [EpisodeId("r1")])
        fleet.parts["environment/env"].start("r9")  # never reaches a boundary
        with pytest.raises(CoordinationFailed):
            await fleet.core.checkpoint("/ck2", None, prepare_s=0.2, trigger="periodic")
        failed = fleet.core.timeline.get("latest")
        assert failed.checkpoint_id != ok.checkpoint_id
        assert (failed.trigger, failed.outcome) == ("periodic", "failed")
        env = [s for s in failed.spans if s.row == "environment/env"]
        # It answered its prepare (not ready, past the deadline), then was resumed.
        assert [s.name for s in env] == ["prepare", "resume"]
        assert env[0].end - env[0].start >= 0.15
        assert fleet.core.timeline.get(ok.checkpoint_id).outcome == "ok"
    finally:
        await fleet.aclose()


def test_only_the_last_ones_are_kept_and_an_unknown_one_is_refused_typed() -> None:
    rec = TimelineRecorder()
    for i in range(KEEP + 3):
        rec.span(f"ckpt-{i}", "environment/env", "prepare", float(i), i + 0.5)
    assert rec.get("latest").checkpoint_id == f"ckpt-{KEEP + 2}"
    with pytest.raises(InvalidRequest, match="keeps the last"):
        rec.get("ckpt-0")
    with pytest.raises(InvalidRequest, match="no checkpoint has run"):
        TimelineRecorder().get("latest")
    # A participant's malformed slices are skipped, never raised.
    rec.reported("ckpt-3", "agent/a", [{"name": "write"}, "x", {"name": 1, "start": 0, "end": 1}])
    rec.reported("ckpt-3", "agent/a", None)
    assert [s.row for s in rec.get("ckpt-3").spans] == ["environment/env"]
