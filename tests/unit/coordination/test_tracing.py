"""OpenTelemetry: a checkpoint over real HTTP servers makes one coordinator span
per phase per participant, inside one checkpoint span, and each participant's
span is a child of the coordinator's call, its context carried on the request."""

from __future__ import annotations

import pathlib
import uuid
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from coordination.engine.coordinator_core import CoordinatorCore
from coordination.engine.journal import Journal
from coordination.engine.order import Member
from coordination.reach.hosts import HttpHost
from participants.fleet import FleetConfig
from participants.local import start_local_fleet
from ray_ckpt.control.client import ControlClient
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import FAST

EXPORTER = InMemorySpanExporter()


class _WhileRecording(SimpleSpanProcessor):
    """Records only while a test asks (a tracer provider is set once per
    process and keeps its processors, so later tests must not pile up spans)."""

    recording = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.recording:
            super().on_end(span)


PROCESSOR = _WhileRecording(EXPORTER)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # set once per process
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
        provider.add_span_processor(PROCESSOR)
    EXPORTER.clear()
    PROCESSOR.recording = True
    try:
        yield EXPORTER
    finally:
        PROCESSOR.recording = False
        EXPORTER.clear()


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
async def test_a_checkpoint_is_one_trace_across_coordinator_and_participants(
    spans: InMemorySpanExporter, tmp_path: pathlib.Path, split: bool
) -> None:
    """Whole, or the split prepare / commit / resume: one checkpoint span,
    every phase call its child."""
    config = FleetConfig(token=f"tok-{uuid.uuid4().hex}")
    fleet = await start_local_fleet(config)
    core = CoordinatorCore(journal=Journal(None), timeouts=FAST)
    keys = []
    cid = None
    try:
        for kind, url in fleet.urls.items():
            member = Member(kind, config.server_name(kind))
            client = ControlClient(url, token=config.token, limit=4, limit_per_host=4)
            core.register(HttpHost(member, client))
            keys.append(member.key)
        if split:
            cid = (await core.prepare()).checkpoint_id
            await core.commit(str(tmp_path / "ck"), [EpisodeId("r1")])
            await core.resume()
        else:
            cid = (await core.checkpoint(str(tmp_path / "ck"), [EpisodeId("r1")])).checkpoint_id
    finally:
        await core.aclose()
        await fleet.stop()
    assert cid is not None
    finished = spans.get_finished_spans()
    (root,) = [s for s in finished if s.name == "ray_ckpt.checkpoint"]
    assert {s.context.trace_id for s in finished} == {root.context.trace_id}
    by_id = {s.context.span_id: s for s in finished}
    for op in ("prepare", "commit", "resume"):
        calls = [s for s in finished if s.name == f"ray_ckpt.{op}"]
        assert sorted(s.attributes["ray_ckpt.participant"] for s in calls) == sorted(keys), op
        for call in calls:
            assert call.attributes["ray_ckpt.checkpoint_id"] == cid
            assert call.parent is not None
            assert by_id[call.parent.span_id].name == "ray_ckpt.checkpoint"
        served = [s for s in finished if s.name == f"ray_ckpt.participant.{op}"]
        assert len(served) == len(keys), op
        # Each participant's span is the child of exactly one coordinator call.
        parents = {s.parent.span_id for s in served if s.parent is not None}
        assert parents == {c.context.span_id for c in calls}, op
