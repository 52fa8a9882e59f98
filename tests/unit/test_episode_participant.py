"""EpisodeParticipant: the Participant hooks by delegation to EpisodeSteps."""

from __future__ import annotations

import asyncio

from ray_ckpt.episode_participant import EpisodeParticipant
from ray_ckpt.identity import EpisodeId
from ray_ckpt.participant import Participant
from ray_ckpt.records import Record
from ray_ckpt.steps import EpisodeSteps


async def test_the_adapter_is_a_participant_over_its_steps() -> None:
    source = EpisodeParticipant("environment", EpisodeSteps())
    assert isinstance(source, Participant)
    assert source.kind == "environment"
    became_ready = asyncio.Event()
    source.bind(lambda: became_ready.set() if source.ready() else became_ready.clear())
    assert source.fresh()

    release = asyncio.Event()
    steps = source.steps

    async def handler() -> None:
        async with steps.begin(EpisodeId("r")) as ep, ep.step("wait", name="tool") as step:
            await release.wait()
            step.boundary({"next": "return"})

    task = asyncio.create_task(handler())
    await asyncio.sleep(0)
    assert not source.fresh()
    assert source.live_executions() == 1
    source.close_admission()
    assert not source.ready()
    report = source.report(5)
    assert [b.key for b in report.blockers] == ["r"]
    assert not became_ready.is_set()
    release.set()
    # The controller's readiness wait is woken by the notify callback alone.
    await asyncio.wait_for(became_ready.wait(), 2)
    records = await source.export([EpisodeId("r")])
    assert records == [Record("r", {"boundary": {"next": "return"}, "step": 1})]

    target = EpisodeParticipant("environment", EpisodeSteps())
    assert await target.install(records) == [EpisodeId("r", 1)]
    assert await target.delete_restored([EpisodeId("r", 1)]) == []
    assert await target.retire([EpisodeId("r", 1)]) == ["r-a1"]
    assert target.steps.restored_ids() == []
    assert target.retiring() == 0

    assert await source.retire([EpisodeId("r")]) == ["r"]
    assert task.cancelled()
    source.open_admission()
    assert source.live_executions() == 0
