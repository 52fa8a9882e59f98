"""EpisodeParticipant: the Participant hooks by delegation to EpisodeSteps."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from ray_ckpt.clock import ManualClock
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.control.protocol import Participant
from ray_ckpt.identity import EpisodeId
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.steps import EpisodeSteps
from ray_ckpt.steps.episode_participant import EpisodeParticipant
from ray_ckpt.storage.records.record import Record
from tests.unit.helpers import T0, body_t0


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
    # The engine's readiness wait is woken by the notify callback alone.
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


async def test_the_real_controller_checkpoints_and_restores_episodes(tmp_path: Path) -> None:
    clock = ManualClock(T0)
    settings = CheckpointSettings(enabled=True, control_auth_token=SecretStr("t"))
    steps = EpisodeSteps(clock=clock)
    ctl = ParticipantEngine(
        EpisodeParticipant("environment", steps), instance="env0", settings=settings, clock=clock
    )
    in_verify = asyncio.Event()
    release = asyncio.Event()

    async def run(steps: EpisodeSteps, eid: EpisodeId) -> Any:
        async with steps.begin(eid) as ep:
            state = ep.claim() or {"next": "seed"}
            if state["next"] == "seed":
                async with ep.step("replay", name="seed") as step:
                    step.boundary({"next": "verify"})
            if ep.boundary_state == {"next": "verify"}:
                async with ep.step("wait", name="verify") as step:
                    in_verify.set()
                    await release.wait()
                    step.boundary({"next": "return", "reward": 1.0})
            return ep.boundary_state["reward"]

    task = asyncio.create_task(run(steps, EpisodeId("r1")))
    await in_verify.wait()
    prepare = asyncio.create_task(ctl.handle("prepare", body_t0("c1")))
    await asyncio.sleep(0.05)
    assert not prepare.done()
    blockers = ctl.status()["report"]["blocker_details"]
    assert [(b["key"], b["state"], b["step"], b["mode"]) for b in blockers] == [
        ("r1", "wait_step", 1, "wait")
    ]
    release.set()
    prepared = await asyncio.wait_for(prepare, 2)
    assert prepared["phase"] == "prepared"
    scope = [{"rollout_id": "r1", "attempt": 0}]
    commit = await ctl.handle(
        "commit", body_t0("c1", checkpoint_dir=str(tmp_path), episode_ids=scope)
    )
    assert commit["episode_ids"] == ["r1"]
    assert not task.done()
    await ctl.handle("resume", body_t0("c1"))
    assert await task == 1.0

    # A fresh process continues r1 as attempt 1 from the boundary after verify.
    steps2 = EpisodeSteps(clock=clock)
    ctl2 = ParticipantEngine(
        EpisodeParticipant("environment", steps2), instance="env0", settings=settings, clock=clock
    )
    restored = await ctl2.handle(
        "restore", body_t0("c1", checkpoint_dir=str(tmp_path), episode_ids=scope)
    )
    assert restored["restored"] == ["r1-a1"]
    await ctl2.handle("resume", body_t0("c1"))
    in_verify.clear()
    assert await run(steps2, EpisodeId("r1", 1)) == 1.0
    assert not in_verify.is_set()  # the wait step is not run again
    assert steps2.live_executions() == 0
