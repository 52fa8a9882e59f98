"""Continuations that are never silently wrong (issue 23), at the episode table.

Each test drives the real `EpisodeSteps` with a ManualClock; handlers are
plain asyncio tasks.  Every scenario here ended with a wrong result or a
wrong export, and no error, before the fix it covers.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from participants.hooks import stage_records as stage_hook_records
from ray_ckpt.clock import ManualClock
from ray_ckpt.errors import InvalidPhase, InvalidRequest, StaleAttempt
from ray_ckpt.identity import EpisodeId
from ray_ckpt.steps import EpisodeSteps, EpisodeTimeout
from ray_ckpt.steps.episode_participant import EpisodeParticipant
from ray_ckpt.steps.persist import EpisodeNotHeld, RolloutExportedTwice
from ray_ckpt.storage.records.record import Record
from tests.unit.helpers import until

R = EpisodeId("r")
R1 = EpisodeId("r", 1)
VERIFY = {"next": "verify", "task_digest": "A"}
RESTORED = Record("r", {"boundary": VERIFY, "step": 2})


def refuse_other_task(boundary: Any) -> None:
    if boundary.get("task_digest") != "B":
        raise InvalidRequest("restored for a different task")


class InStep:
    """An episode sitting in a replay step (at its boundary for a checkpoint)."""

    def __init__(self, steps: EpisodeSteps, eid: EpisodeId, boundary: Any, **kw: Any) -> None:
        self.release = asyncio.Event()
        self.entered = asyncio.Event()
        self.ep = steps.begin(eid, boundary=boundary, **kw)
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async with self.ep, self.ep.step("replay"):
            self.entered.set()
            await self.release.wait()

    async def started(self) -> InStep:
        await self.entered.wait()
        return self

    async def end(self) -> None:
        self.release.set()
        await self.task


def restored_table() -> EpisodeSteps:
    steps = EpisodeSteps(clock=ManualClock())
    steps.install([RESTORED])
    return steps


# --- 1. a refused or failed continuation keeps the restored boundary ----------------


async def test_a_mismatched_continuation_is_refused_in_begin_touching_nothing() -> None:
    steps = restored_table()
    with pytest.raises(InvalidRequest, match="different task"):
        steps.begin(R1, expect=refuse_other_task)
    assert steps.restored_ids() == [R1]
    assert steps.live_executions() == 0
    assert steps.fresh()  # nothing began
    with pytest.raises(StaleAttempt):
        steps.begin(R)  # still fenced
    steps.close_admission()
    assert steps.export(None) == [Record("r-a1", RESTORED.state)]  # still exported
    ep = steps.begin(R1, expect=lambda b: None)  # the right continuation
    assert ep.claim() == VERIFY  # still claimable
    ep.close()


async def test_a_continuation_that_fails_before_a_boundary_of_its_own_leaves_the_entry() -> None:
    steps = restored_table()

    async def failing() -> None:
        async with steps.begin(R1) as ep:
            assert ep.claim() == VERIFY
            async with ep.step("wait", name="verify"):
                raise RuntimeError("judge down")

    with pytest.raises(RuntimeError):
        await failing()
    assert steps.restored_ids() == [R1]
    with pytest.raises(StaleAttempt):
        steps.begin(R)
    steps.close_admission()
    assert steps.export(None) == [Record("r-a1", RESTORED.state)]
    steps.open_admission()
    # The next continuation starts from the restored boundary, not from seed.
    async with steps.begin(R1) as ep:
        assert ep.claim() == VERIFY
        async with ep.step("wait", name="verify") as st:
            st.boundary({"next": "return"})
        # It moved on: the restored entry is spent, the live attempt owns the slot.
        assert steps.restored_ids() == []
        with pytest.raises(StaleAttempt):
            steps.begin(R)
    assert steps.restored_ids() == []
    steps.begin(R).close()  # nothing newer is held once r-a1 ended


async def test_a_continuation_that_completes_from_the_restored_boundary_spends_it() -> None:
    steps = EpisodeSteps(clock=ManualClock())
    steps.install([Record("r", {"boundary": {"next": "return"}, "step": 3})])
    async with steps.begin(R1) as ep:
        assert ep.claim() == {"next": "return"}
    assert steps.restored_ids() == []
    steps.close_admission()
    assert steps.export(None) == []


# --- 2. no outcome leaves while admission is closed ----------------------------------


async def test_a_deadline_inside_a_wait_step_holds_its_failure_until_reopen() -> None:
    clock = ManualClock()
    steps = EpisodeSteps(clock=clock)
    in_step = asyncio.Event()

    async def handler() -> None:
        ep = steps.begin(R, deadline_s=5.0, boundary=VERIFY)
        async with ep, ep.deadline(poll_s=0.005), ep.step("wait", name="verify") as st:
            in_step.set()
            await asyncio.Event().wait()  # a verify slower than the budget
            st.boundary({"never": "reached"})

    task = asyncio.create_task(handler())
    await in_step.wait()
    steps.close_admission()
    assert not steps.ready()  # the checkpoint waits for the wait step
    clock.advance(6.0)  # the budget runs out inside it, under the checkpoint
    await until(steps.ready)
    await asyncio.sleep(0.02)
    assert not task.done()  # the failure does not leave during the checkpoint
    assert steps.report(5).counts == {"parked": 1}
    (record,) = steps.export([R])
    assert record.state["boundary"] == VERIFY
    assert record.state["spent_s"] == 5.0  # a continuation has no budget left
    steps.open_admission()
    with pytest.raises(EpisodeTimeout):
        await task
    assert steps.live_executions() == 0


async def test_any_failure_in_a_wait_step_waits_for_reopen() -> None:
    steps = EpisodeSteps(clock=ManualClock())
    fail = asyncio.Event()

    async def handler() -> None:
        async with steps.begin(R, boundary=VERIFY) as ep, ep.step("wait"):
            await fail.wait()
            raise RuntimeError("tool crashed")

    task = asyncio.create_task(handler())
    await until(lambda: steps.report(5).counts == {"wait_step": 1})
    steps.close_admission()
    fail.set()
    await until(steps.ready)
    await asyncio.sleep(0.02)
    assert not task.done()
    assert steps.export(None) == [Record("r", {"boundary": VERIFY, "step": 0})]
    steps.open_admission()
    with pytest.raises(RuntimeError, match="tool crashed"):
        await task


async def test_a_commit_naming_an_episode_served_this_checkpoint_but_gone_fails() -> None:
    steps = EpisodeSteps(clock=ManualClock())
    gone = steps.begin(EpisodeId("gone"), boundary={"n": 1})
    kept = await InStep(steps, EpisodeId("kept"), {"n": 2}).started()
    await InStep(steps, EpisodeId("retired"), {"n": 3}).started()
    steps.close_admission()
    gone.close()  # freed while closed: its capture is lost
    assert await steps.retire([EpisodeId("retired")]) == ["retired"]
    participant = EpisodeParticipant("environment", steps)
    with pytest.raises(EpisodeNotHeld, match="gone") as info:
        await participant.export([EpisodeId("gone"), EpisodeId("kept")])
    assert info.value.code == "invalid_phase"
    # Served elsewhere (never here), or retired by the control plane: not an error.
    scopes = (
        [EpisodeId("kept"), EpisodeId("elsewhere")],
        [EpisodeId("retired"), EpisodeId("kept")],
    )
    for scope in scopes:
        assert [r.key for r in await participant.export(scope)] == ["kept"]
    # A table whose owner keeps state beyond the episode (the agent) opts out.
    assert [r.key for r in steps.export([EpisodeId("gone"), EpisodeId("kept")])] == ["kept"]
    steps.open_admission()
    steps.close_admission()  # a new checkpoint: `gone` ended before it
    assert [r.key for r in await participant.export([EpisodeId("gone"), EpisodeId("kept")])] == [
        "kept"
    ]
    steps.open_admission()
    await kept.end()


# --- 3. deadlines ----------------------------------------------------------------


async def test_a_restart_episode_is_not_charged_while_a_checkpoint_holds_it() -> None:
    clock = ManualClock()
    steps = EpisodeSteps(clock=clock)
    downstream = asyncio.Event()  # a call held at a downstream gate
    in_step = asyncio.Event()

    async def handler() -> str:
        async with steps.begin(R, deadline_s=1.0) as ep:
            ep.mark_restart()
            async with ep.deadline(poll_s=0.005), ep.step("replay", name="agent-0"):
                in_step.set()
                await downstream.wait()
                clock.advance(0.25)  # the episode's own work
            return "done"

    task = asyncio.create_task(handler())
    await in_step.wait()
    steps.close_admission()
    clock.advance(2.0)  # the checkpoint stays open 2 s
    await asyncio.sleep(0.03)  # the deadline polls meanwhile
    assert not task.done()
    steps.open_admission()
    downstream.set()
    assert await task == "done"


async def test_a_restored_attempt_continues_with_the_budget_it_had_left() -> None:
    clock = ManualClock()
    old = EpisodeSteps(clock=clock)
    first = await InStep(old, R, VERIFY, deadline_s=10.0).started()
    clock.advance(4.0)
    old.close_admission()
    clock.advance(3.0)  # held by the checkpoint: not charged
    (record,) = old.export(None)
    assert record.state["spent_s"] == 4.0
    first.task.cancel()  # the crash
    new = EpisodeSteps(clock=clock)
    new.install([record])
    cont = await InStep(new, R1, None, deadline_s=10.0).started()
    assert cont.ep.remaining() == 6.0
    clock.advance(1.0)
    new.close_admission()
    (again,) = new.export(None)
    assert again.state["spent_s"] == 5.0  # a second crash cannot stretch it either
    cont.task.cancel()


async def test_a_record_with_a_bad_spent_budget_is_refused() -> None:
    for spent in (-1.0, True, "3", float("inf")):
        steps = EpisodeSteps()
        with pytest.raises(Exception, match="spent_s"):
            steps.install([Record("r", {"boundary": None, "step": 0, "spent_s": spent})])
        assert steps.restored_ids() == []


# --- 4. one attempt per rollout ------------------------------------------------------


async def test_two_live_attempts_of_one_rollout_are_never_both_exported() -> None:
    steps = EpisodeSteps(clock=ManualClock())
    old = await InStep(steps, R, {"n": 1}).started()
    new = await InStep(steps, R1, {"n": 2}).started()
    steps.close_admission()
    for scope in (None, [R, R1]):
        with pytest.raises(RolloutExportedTwice, match="rollout r: attempts r and r-a1"):
            steps.export(scope)
    assert [r.key for r in steps.export([R1])] == ["r-a1"]
    steps.open_admission()
    await old.end()
    await new.end()


async def test_a_live_attempt_beside_a_restored_one_is_not_exported_twice() -> None:
    steps = restored_table()
    newer = await InStep(steps, EpisodeId("r", 2), None).started()  # supersedes r-a1
    steps.close_admission()
    with pytest.raises(RolloutExportedTwice, match="rollout r"):
        steps.export(None)
    steps.open_admission()
    await newer.end()


async def test_the_restored_twice_check_is_linear() -> None:
    records = [Record(f"r{i}", {"x": i}) for i in range(40_000)]
    start = time.perf_counter()
    staged = stage_hook_records(records, lambda r: r.state)
    assert len(staged) == 40_000
    # Quadratic took minutes here; linear takes well under a second.
    assert time.perf_counter() - start < 3.0


# --- 5. misuse caught --------------------------------------------------------------


async def test_a_boundary_recorded_after_a_wait_step_is_what_the_checkpoint_exports() -> None:
    steps = EpisodeSteps(clock=ManualClock())
    step_done, between, went_on = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def handler() -> None:
        async with steps.begin(R, boundary={"next": "tool"}) as ep:
            async with ep.step("wait", name="tool"):
                await step_done.wait()
            await between.wait()
            ep.boundary({"next": "verify"})  # misuse: outside the step
            await went_on.wait()

    task = asyncio.create_task(handler())
    await until(lambda: steps.report(5).counts == {"wait_step": 1})
    steps.close_admission()
    step_done.set()
    await asyncio.sleep(0.02)
    # Never exported at the boundary before the step (it would run twice).
    assert not steps.ready()
    assert steps.report(5).blockers[0].detail == "after tool"
    with pytest.raises(InvalidPhase):
        steps.export(None)
    between.set()
    await asyncio.sleep(0.02)
    assert not steps.ready()  # boundary recorded, not yet at a park point
    went_on.set()
    await until(steps.ready)  # parked at its end, at the boundary it recorded
    assert steps.export(None) == [Record("r", {"boundary": {"next": "verify"}, "step": 0})]
    steps.open_admission()
    await task


async def test_a_cancelled_replay_step_does_not_make_a_prepared_table_unready() -> None:
    steps = EpisodeSteps(clock=ManualClock())
    in_step = asyncio.Event()

    async def handler() -> None:
        async with steps.begin(R, boundary=VERIFY) as ep, ep.step("replay"):
            in_step.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(handler())
    await in_step.wait()
    steps.close_admission()
    assert steps.ready()
    seen: list[bool] = []
    steps.bind(lambda: seen.append(steps.ready()))
    task.cancel()  # not a retire: a dropped caller, a shutdown
    with pytest.raises(asyncio.CancelledError):
        await task  # a cancel still ends the task, checkpoint or not
    assert seen
    assert all(seen)
    assert steps.ready()
