"""The timeline saved with each checkpoint, from the same span records as the
traces and the metrics, and each restore's restart bias, saved beside it."""

from __future__ import annotations

import pathlib

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from coordination.engine.metrics import CoordinatorMetrics
from coordination.engine.timeline import COORDINATOR_ROW, StorageHistory
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.root.history import (
    RESTORES_PREFIX,
    TIMELINE_KEY,
    read_history,
    read_timeline,
)
from tests.unit.coordination.coord_fleet import Fleet, make_fleet
from tests.unit.coordination.test_coordinator_metrics import RecordingSink
from tests.unit.coordination.test_tracing import spans  # noqa: F401 - a fixture

KEYS = ("environment/env", "model/policy", "agent/agent", "resources/res")
# rollout → steps done when checkpointed
STEPS = {"r1": 4, "r2": 12, "r3": 0}


def files(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


async def checkpointed(directory: str) -> Fleet:
    fleet = make_fleet()
    fleet.core.history = StorageHistory()
    for key in KEYS:
        for rollout, steps in STEPS.items():
            # The steps framework's record shape: `step` is the steps done.
            fleet.parts[key].start(rollout, at_boundary=True, state={"step": steps})
    return fleet


async def test_the_saved_timeline_is_the_span_records_the_traces_and_metrics_got(
    tmp_path: pathlib.Path,
    spans: InMemorySpanExporter,  # noqa: F811
) -> None:
    directory = tmp_path / "step-1"
    fleet = await checkpointed(str(directory))
    sink = RecordingSink()
    fleet.core.metrics = CoordinatorMetrics(sink)
    try:
        res = await fleet.core.checkpoint(
            str(directory), [EpisodeId(r) for r in STEPS], trigger="periodic"
        )
        kept = fleet.core.timeline.get(res.checkpoint_id)
    finally:
        await fleet.aclose()
    # Saved beside the Gym manifest, readable with no coordinator at all.
    assert (directory / TIMELINE_KEY).is_file()
    saved = read_timeline(str(directory))
    assert saved is not None
    assert saved == kept
    assert (saved.op, saved.trigger, saved.outcome, saved.durability) == (
        "checkpoint",
        "periodic",
        "ok",
        "sync",
    )
    assert saved.checkpoint_dir == str(directory)
    assert {r: saved.progress[r].steps for r in STEPS} == STEPS
    assert sorted(saved.continued) == sorted(STEPS)
    rows = {s.row for s in saved.spans}
    assert rows == {COORDINATOR_ROW, *KEYS}
    for key in KEYS:
        assert [
            s.name
            for s in saved.spans
            if s.row == key and s.name in ("prepare", "commit", "resume")
        ] == [
            "prepare",
            "commit",
            "resume",
        ]
    # The same records: the metrics' call timings ...
    commits = [s for s in saved.spans if s.name == "commit"]
    assert sorted(v for v, _ in sink.values("commit_seconds")) == sorted(s.seconds for s in commits)
    # ... and OpenTelemetry's spans, to the nanosecond.
    otel = {
        (s.attributes or {}).get("ray_ckpt.participant"): s
        for s in spans.get_finished_spans()
        if s.name == "ray_ckpt.commit"
    }
    for s in commits:
        assert (otel[s.row].start_time, otel[s.row].end_time) == (
            int(s.start * 1e9),
            int(s.end * 1e9),
        )
    publish = [s for s in saved.spans if s.row == COORDINATOR_ROW and s.name == "publish"]
    assert len(publish) == 1
    assert any(s.name == "ray_ckpt.publish" for s in spans.get_finished_spans())


async def test_a_restore_reports_its_restart_bias_and_leaves_the_checkpoint_as_it_was(
    tmp_path: pathlib.Path,
) -> None:
    directory = tmp_path / "step-1"
    fleet = await checkpointed(str(directory))
    try:
        await fleet.core.checkpoint(str(directory), [EpisodeId(r) for r in STEPS])
    finally:
        await fleet.aclose()
    before = files(directory)
    # A new coordinator (the old one's memory is gone) on a fresh fleet.
    fresh = make_fleet(store=fleet.store)
    fresh.core.history = StorageHistory()
    sink = RecordingSink()
    fresh.core.metrics = CoordinatorMetrics(sink)
    try:
        # r1 and r3 continue, r9 was never checkpointed (starts over), r2 is lost.
        res = await fresh.core.restore(
            str(directory), [EpisodeId("r1"), EpisodeId("r3"), EpisodeId("r9")]
        )
    finally:
        await fresh.aclose()
    bias = res.restart_bias
    assert bias is not None
    assert bias.known
    table = bias.as_table()
    assert table["3-5"] == {"continued": 1, "restarted": 0, "lost": 0}  # r1: 4 steps
    assert table["0"] == {"continued": 1, "restarted": 0, "lost": 0}  # r3
    assert table["11+"] == {"continued": 0, "restarted": 0, "lost": 1}  # r2: 12 steps
    assert table["unknown"] == {"continued": 0, "restarted": 1, "lost": 0}  # r9
    assert bias.totals() == {"continued": 2, "restarted": 1, "lost": 1}
    # The metric family, by outcome and bucket.
    episodes = {(t["outcome"], t["bucket"]): v for v, t in sink.values("restore_episodes") if v}
    assert episodes == {
        ("continued", "3-5"): 1,
        ("continued", "0"): 1,
        ("lost", "11+"): 1,
        ("restarted", "unknown"): 1,
    }
    # Its own timeline beside the checkpoint's; the checkpoint's files untouched.
    after = files(directory)
    added = set(after) - set(before)
    assert added == {f"{RESTORES_PREFIX}{res.checkpoint_id}.json"}
    assert {k: after[k] for k in before} == before
    history = read_history(str(directory))
    assert history.problems == []
    [restore] = history.restores
    assert (restore.op, restore.outcome, restore.restart_bias) == ("restore", "ok", bias)
    assert {s.row for s in restore.spans} == set(KEYS)


async def test_without_a_saved_timeline_the_bias_says_it_is_unknown(
    tmp_path: pathlib.Path,
) -> None:
    fleet = await checkpointed(str(tmp_path / "c"))
    fleet.core.history = None  # nothing saved: an older checkpoint
    try:
        await fleet.core.checkpoint(str(tmp_path / "c"), [EpisodeId("r1")])
    finally:
        await fleet.aclose()
    fresh = make_fleet(store=fleet.store)
    fresh.core.history = StorageHistory()
    try:
        res = await fresh.core.restore(str(tmp_path / "c"), [EpisodeId("r1")])
    finally:
        await fresh.aclose()
    assert res.restart_bias is not None
    assert not res.restart_bias.known
    assert res.restart_bias.totals() == {"continued": 1, "restarted": 0, "lost": 0}
    assert res.restart_bias.as_table()["unknown"]["continued"] == 1
