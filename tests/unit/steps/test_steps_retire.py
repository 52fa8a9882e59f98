"""Retire: cancel once, wait for cleanup, free, leave no task behind."""

from __future__ import annotations

import asyncio

import pytest

from ray_ckpt.clock import ManualClock
from ray_ckpt.errors import StaleAttempt
from ray_ckpt.identity import EpisodeId
from ray_ckpt.steps import EpisodeState, EpisodeSteps
from ray_ckpt.storage.records.record import Record
from tests.unit.helpers import until


async def test_retire_mid_step_runs_cleanup_frees_state_and_leaves_no_task() -> None:
    steps = EpisodeSteps(clock=ManualClock())
    before = asyncio.all_tasks()
    cleaned: list[str] = []
    in_step = asyncio.Event()

    async def handler(eid: EpisodeId) -> None:
        try:
            async with steps.begin(eid) as ep, ep.step("wait", name="tool"):
                in_step.set()
                await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # cleanup may await and is not interrupted
            cleaned.append(eid.capture_key)

    tasks = [
        asyncio.create_task(handler(EpisodeId("r", 1))),
        asyncio.create_task(handler(EpisodeId("s"))),
    ]
    await in_step.wait()
    await until(lambda: steps.live_executions() == 2)
    # Retiring attempt 2 stops attempt 1 too (every attempt <= N), not rollout s.
    assert await steps.retire([EpisodeId("r", 2)]) == ["r-a1"]
    assert cleaned == ["r-a1"]
    assert tasks[0].cancelled()
    assert steps.live_executions() == 1
    assert steps.retiring() == 0
    assert await steps.retire([EpisodeId("s")]) == ["s"]
    assert cleaned == ["r-a1", "s"]
    assert steps.live_executions() == 0
    report = steps.report(10)
    assert report.counts == {}
    assert report.blocker_count == 0
    assert asyncio.all_tasks() == before
    steps.begin(EpisodeId("r")).close()  # nothing of r-a1 is left to supersede it


async def test_a_step_that_ignores_cancellation_is_a_retiring_blocker() -> None:
    clock = ManualClock()
    steps = EpisodeSteps(clock=clock)
    in_step = asyncio.Event()
    let_go = asyncio.Event()
    cancels: list[int] = []

    async def stubborn() -> None:
        async with steps.begin(EpisodeId("r")) as ep, ep.step("replay", name="sandbox"):
            in_step.set()
            while True:
                try:
                    await let_go.wait()
                    return
                except asyncio.CancelledError:
                    cancels.append(1)  # swallowed: the step keeps going

    task = asyncio.create_task(stubborn())
    await in_step.wait()
    clock.advance(4)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(steps.retire([EpisodeId("r")]), 0.05)
    assert steps.retiring() == 1
    report = steps.report(10)
    assert not report.ready
    (blocker,) = report.blockers
    assert (blocker.key, blocker.state, blocker.step, blocker.mode, blocker.detail) == (
        "r",
        "retiring",
        0,
        "replay",
        "sandbox",
    )
    assert blocker.running_s == 4.0
    with pytest.raises(StaleAttempt):
        steps.begin(EpisodeId("r"))  # still being stopped

    # A second retire waits again but does not cancel a second time.
    second = asyncio.create_task(steps.retire([EpisodeId("r")]))
    await asyncio.sleep(0.01)
    assert cancels == [1]
    let_go.set()
    assert await second == ["r"]
    await task
    assert steps.live_executions() == 0
    assert steps.retiring() == 0
    assert steps.ready()


async def test_a_retire_cancelled_by_its_deadline_still_frees_when_the_task_ends() -> None:
    steps = EpisodeSteps()
    release = asyncio.Event()

    async def slow_cleanup() -> None:
        async with steps.begin(EpisodeId("r")) as ep:
            try:
                async with ep.step("wait"):
                    await asyncio.Event().wait()
            finally:
                await release.wait()

    task = asyncio.create_task(slow_cleanup())
    await until(lambda: steps.live_executions() == 1)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(steps.retire([EpisodeId("r")]), 0.02)
    assert steps.report(5).counts == {"retiring": 1}
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps.live_executions() == 0
    assert steps.report(5).counts == {}


async def test_retire_frees_restored_state_and_parked_episodes() -> None:
    steps = EpisodeSteps()
    steps.install(
        [
            Record("a", {"boundary": None, "step": 0}),
            Record("b", {"boundary": None, "step": 0}),
        ]
    )
    parked = asyncio.Event()

    async def replacement() -> None:
        async with steps.begin(EpisodeId("b", 1)) as ep:
            parked.set()
            async with ep.step("wait"):
                pass

    steps.close_admission()  # the restored phase keeps admission closed
    task = asyncio.create_task(replacement())
    await parked.wait()
    await until(lambda: steps.report(5).counts.get("parked") == 1)
    assert await steps.retire([EpisodeId("a", 1), EpisodeId("b", 1)]) == ["a-a1", "b-a1"]
    assert task.cancelled()
    assert steps.restored_ids() == []
    assert steps.live_executions() == 0
    assert steps.report(5).counts == {}


async def test_retire_of_an_episode_whose_task_already_ended_frees_it() -> None:
    steps = EpisodeSteps()

    async def leak() -> None:
        steps.begin(EpisodeId("r"))  # never closed by its handler

    await asyncio.create_task(leak())
    assert steps.live_executions() == 1
    assert steps.episodes()[0].state is EpisodeState.RUNNING
    assert await steps.retire([EpisodeId("r")]) == ["r"]
    assert steps.live_executions() == 0
    assert await steps.retire([EpisodeId("r")]) == []
