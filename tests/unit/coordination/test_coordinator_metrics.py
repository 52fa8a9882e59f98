"""The coordinator's metrics: what a checkpoint or restore records, with which
labels (never a rollout or checkpoint ID), for a success and for a failure."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from coordination.engine.metrics import DEFINITIONS, CoordinatorMetrics
from ray_ckpt.errors import CoordinationFailed
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import make_fleet


class RecordingSink:
    def __init__(self) -> None:
        self.seen: list[tuple[str, float, dict[str, str]]] = []

    def record(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        _kind, _, keys = DEFINITIONS[name]  # an unknown name fails here
        assert set(tags) == set(keys), (name, tags)
        self.seen.append((name, value, dict(tags)))

    def values(self, name: str) -> list[tuple[float, dict[str, str]]]:
        return [(v, t) for n, v, t in self.seen if n == name]


async def test_a_checkpoint_records_its_timings_bytes_and_episodes_by_trigger() -> None:
    fleet = make_fleet()
    sink = RecordingSink()
    fleet.core.metrics = CoordinatorMetrics(sink)
    try:
        fleet.parts["environment/env"].start("r1", at_boundary=True, state={"x": 1})
        result = await fleet.core.checkpoint(
            "/ck", [EpisodeId("r1"), EpisodeId("r2")], trigger="drain"
        )
        assert sink.values("checkpoints_total") == [(1, {"trigger": "drain", "outcome": "ok"})]
        [(total, _)] = sink.values("total_save_seconds")
        assert total == result.total_s
        [(hold, _)] = sink.values("exclusive_hold_seconds")
        assert hold == total  # prepare to resume: admission closed
        kinds = {t["kind"] for _, t in sink.values("commit_seconds")}
        assert kinds == {"environment", "model", "agent", "resources"}
        written = {t["kind"]: v for v, t in sink.values("bytes_written_total")}
        assert written == {k.split("/")[0]: n for k, n in result.bytes.items()}
        assert sink.values("episodes_continued_total") == [(1, {"phase": "checkpoint"})]
        assert sink.values("episodes_restarted_total") == [(1, {"phase": "checkpoint"})]
        for _, _, tags in sink.seen:  # low cardinality: no IDs in any label
            assert result.checkpoint_id not in tags.values()
            assert "r1" not in tags.values()
    finally:
        await fleet.aclose()


async def test_a_failed_checkpoint_counts_its_phase_and_code() -> None:
    fleet = make_fleet()
    sink = RecordingSink()
    fleet.core.metrics = CoordinatorMetrics(sink)
    try:
        fleet.parts["environment/env"].start("r9")  # never reaches a boundary
        with pytest.raises(CoordinationFailed):
            await fleet.core.checkpoint("/ck", None, prepare_s=0.2, trigger="signal")
        assert sink.values("checkpoints_total") == [(1, {"trigger": "signal", "outcome": "failed"})]
        failures = sink.values("failures_total")
        assert failures
        assert all(t["phase"] == "prepare" for _, t in failures)
        assert {t["code"] for _, t in failures} == {"deadline_exceeded"}
    finally:
        await fleet.aclose()


async def test_restore_records_seconds_and_what_continues() -> None:
    source = make_fleet()
    for key in source.parts:
        source.parts[key].start("r1", at_boundary=True, state={"at": key})
    await source.core.checkpoint("/ck", [EpisodeId("r1")])
    await source.aclose()
    fleet = make_fleet(store=source.store)
    sink = RecordingSink()
    fleet.core.metrics = CoordinatorMetrics(sink)
    try:
        await fleet.core.restore("/ck", [EpisodeId("r1")])
        assert [t for _, t in sink.values("restore_seconds")] == [{"outcome": "ok"}]
        assert sink.values("episodes_continued_total") == [(1, {"phase": "restore"})]
        with pytest.raises(CoordinationFailed):  # a directory none of them wrote to
            await fleet.core.restore("/elsewhere", [EpisodeId("r1")])
        assert [t for _, t in sink.values("restore_seconds")][-1] == {"outcome": "failed"}
        failures = [t for _, t in sink.values("failures_total")]
        assert failures == [{"phase": "restore", "code": "invalid_checkpoint_state"}] * 4
    finally:
        await fleet.aclose()


async def test_an_asynchronous_checkpoint_reports_durable_seconds_under_its_trigger() -> None:
    fleet = make_fleet()
    sink = RecordingSink()
    fleet.core.metrics = CoordinatorMetrics(sink)
    try:
        pending = await fleet.core.checkpoint(
            "/ck-async", [EpisodeId("r1")], durability="async", trigger="periodic"
        )
        await fleet.core.durable(pending.checkpoint_id)
        [(_, tags)] = sink.values("durable_seconds")
        assert tags == {"trigger": "periodic"}
    finally:
        await fleet.aclose()
