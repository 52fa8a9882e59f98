"""EpisodeSteps core: modes under a checkpoint, parked time, readiness, records.

Handlers run as plain asyncio tasks here; the loopback HTTP scenarios are in
test_steps_http.py.  Time is a ManualClock, so durations are asserted exactly.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ray_ckpt.clock import ManualClock
from ray_ckpt.errors import (
    AdmissionClosed,
    CheckpointError,
    InvalidCheckpointState,
    InvalidPhase,
    RestartInScope,
    StaleAttempt,
)
from ray_ckpt.identity import EpisodeId
from ray_ckpt.steps import EpisodeState, EpisodeSteps, EpisodeTimeout, StepMode
from ray_ckpt.storage.records.record import Record
from tests.unit.helpers import until

R1 = EpisodeId("r1")


class Script:
    """A two-step handler whose second step blocks on an event the test holds."""

    def __init__(self, steps: EpisodeSteps, eid: EpisodeId, mode: StepMode) -> None:
        self.steps, self.eid, self.mode = steps, eid, mode
        self.release = asyncio.Event()
        self.in_step = asyncio.Event()
        self.runs = 0
        self.done = False

    async def __call__(self) -> Any:
        async with self.steps.begin(self.eid, boundary={"next": "seed"}) as ep:
            async with ep.step("wait", name="seed") as step:
                step.boundary({"next": "verify"})
            async with ep.step(self.mode, name="verify") as step:
                self.runs += 1
                self.in_step.set()
                await self.release.wait()
                step.boundary({"next": "return", "reward": 1.0})
            self.done = True
            return ep.boundary_state


async def test_a_wait_step_blocks_the_checkpoint_and_exports_the_boundary_after_it() -> None:
    clock = ManualClock()
    steps = EpisodeSteps(clock=clock)
    wakes: list[bool] = []
    steps.bind(lambda: wakes.append(steps.ready()))
    script = Script(steps, R1, StepMode.WAIT)
    task = asyncio.create_task(script())
    await script.in_step.wait()
    clock.advance(7.5)

    steps.close_admission()
    assert not steps.ready()
    report = steps.report(10)
    assert report.blocker_count == 1
    (blocker,) = report.blockers
    assert (blocker.key, blocker.state, blocker.step, blocker.mode, blocker.detail) == (
        "r1",
        "wait_step",
        1,
        "wait",
        "verify",
    )
    assert blocker.running_s == 7.5
    with pytest.raises(InvalidPhase):
        steps.export(None)

    script.release.set()
    await until(steps.ready)
    assert wakes[-1] is True  # the engine's readiness wait was woken
    assert steps.report(10).counts == {"parked": 1}
    (record,) = steps.export(None)
    assert record == Record("r1", {"boundary": {"next": "return", "reward": 1.0}, "step": 2})
    await asyncio.sleep(0.01)
    assert not script.done  # parked at the boundary after the step: no result yet

    steps.open_admission()
    assert await task == {"next": "return", "reward": 1.0}
    assert steps.live_executions() == 0
    assert steps.ready()


async def test_a_replay_step_does_not_block_and_exports_the_boundary_before_it() -> None:
    steps = EpisodeSteps(clock=ManualClock())
    script = Script(steps, R1, StepMode.REPLAY)
    task = asyncio.create_task(script())
    await script.in_step.wait()

    steps.close_admission()
    assert steps.ready()
    assert steps.report(10).counts == {"replay_step": 1}
    before = Record("r1", {"boundary": {"next": "verify"}, "step": 1})
    assert steps.export(None) == [before]

    # Completing while closed does not move the exported boundary, and the
    # handler does not proceed until reopen.
    script.release.set()
    await until(lambda: steps.report(10).counts == {"parked": 1})
    assert steps.export(None) == [before]
    assert not script.done

    steps.open_admission()
    assert await task == {"next": "return", "reward": 1.0}
    assert script.runs == 1


async def test_a_step_not_started_when_admission_closes_waits_for_reopen() -> None:
    steps = EpisodeSteps(clock=ManualClock())
    gate = asyncio.Event()
    started: list[str] = []

    async def handler() -> None:
        async with steps.begin(R1, boundary={"next": "a"}) as ep:
            await gate.wait()
            async with ep.step("replay", name="a") as step:
                started.append("a")
                step.boundary({"next": "b"})

    task = asyncio.create_task(handler())
    await asyncio.sleep(0)
    steps.close_admission()
    assert not steps.ready()  # running outside any step: not at a boundary
    gate.set()
    await until(steps.ready)
    assert steps.report(5).counts == {"parked": 1}
    assert steps.export(None) == [Record("r1", {"boundary": {"next": "a"}, "step": 0})]

    # Reopen and close again before the episode runs: it stays parked.
    steps.open_admission()
    steps.close_admission()
    await asyncio.sleep(0.01)
    assert started == []
    steps.open_admission()
    await task
    assert started == ["a"]


async def test_parked_time_does_not_count_against_the_deadline() -> None:
    clock = ManualClock()
    steps = EpisodeSteps(clock=clock)
    go = asyncio.Event()
    ep = steps.begin(R1, deadline_s=30.0)
    clock.advance(5)
    assert ep.remaining() == 25.0

    async def next_step() -> None:
        async with ep.step("wait", name="next"):
            await go.wait()

    steps.close_admission()
    task = asyncio.create_task(next_step())
    await until(lambda: ep.state is EpisodeState.PARKED)
    clock.advance(20)
    assert ep.remaining() == 25.0
    assert ep.parked_s() == 20.0
    steps.open_admission()
    await until(lambda: ep.state is EpisodeState.WAIT_STEP)
    clock.advance(3)
    assert ep.remaining() == 22.0

    # A wait step under a closed checkpoint is working: its time counts.
    steps.close_admission()
    clock.advance(2)
    assert ep.remaining() == 20.0
    steps.open_admission()
    go.set()
    await task
    ep.close()


async def test_a_replay_step_under_a_closed_checkpoint_is_parked_time() -> None:
    clock = ManualClock()
    steps = EpisodeSteps(clock=clock)
    ep = steps.begin(R1, deadline_s=10.0)
    async with ep.step("replay"):
        clock.advance(1)
        steps.close_admission()
        clock.advance(100)
        assert ep.remaining() == 9.0
        steps.open_admission()
        clock.advance(2)
    assert ep.remaining() == 7.0
    ep.close()


async def test_the_deadline_scope_times_out_on_working_time_only() -> None:
    clock = ManualClock()
    steps = EpisodeSteps(clock=clock)
    ep = steps.begin(R1, deadline_s=30.0)
    finished = asyncio.Event()

    async def work() -> str:
        async with ep.deadline(poll_s=0.001), ep.step("replay"):
            await finished.wait()
        return "done"

    steps.close_admission()
    task = asyncio.create_task(work())
    await until(lambda: ep.state is EpisodeState.PARKED)
    clock.advance(1000)  # parked: the budget does not move
    await asyncio.sleep(0.01)
    assert not task.done()
    steps.open_admission()
    await until(lambda: ep.state is EpisodeState.REPLAY_STEP)
    clock.advance(29.5)
    await asyncio.sleep(0.01)
    assert not task.done()
    clock.advance(0.5)
    with pytest.raises(EpisodeTimeout) as info:
        await task
    assert isinstance(info.value, TimeoutError)
    assert info.value.code == "deadline_exceeded"
    assert ep.remaining() == 0.0
    ep.close()


async def test_new_episodes_are_refused_while_closed_but_a_restored_one_begins() -> None:
    steps = EpisodeSteps(clock=ManualClock())
    assert steps.install([Record("r1", {"boundary": {"next": "verify"}, "step": 1})]) == [
        EpisodeId("r1", 1)
    ]
    steps.close_admission()
    with pytest.raises(AdmissionClosed):
        steps.begin(EpisodeId("r2"))
    with pytest.raises(StaleAttempt):
        steps.begin(EpisodeId("r1", 0))  # the dead attempt
    ep = steps.begin(EpisodeId("r1", 1), boundary={"next": "seed"})
    assert ep.boundary_state == {"next": "verify"}
    assert ep.step_index == 1
    assert ep.claim() == {"next": "verify"}
    assert ep.claim() is None
    assert steps.claim(EpisodeId("r1", 1)) is None

    async def verify() -> None:
        async with ep.step("wait", name="verify") as step:
            step.boundary({"next": "return"})

    task = asyncio.create_task(verify())
    await until(steps.ready)  # its first step parks: still the restored boundary
    assert steps.export(None) == [Record("r1-a1", {"boundary": {"next": "verify"}, "step": 1})]
    steps.open_admission()
    await task
    assert ep.step_index == 2
    ep.close()
    steps.close_admission()
    assert steps.export(None) == []


async def test_claim_hands_a_restored_boundary_over_exactly_once() -> None:
    steps = EpisodeSteps()
    steps.install([Record("r1-a2", {"boundary": ["x", 1], "step": 4})])
    nxt = EpisodeId("r1", 3)
    assert steps.claim(EpisodeId("r1", 2)) is None
    # Before the replacement begins nothing is handed over (and nothing
    # consumed): the boundary a handler starts from is the one it exports.
    assert steps.claim(nxt) is None
    ep = steps.begin(nxt)
    assert ep.boundary_state == ["x", 1]
    assert steps.claim(nxt) == ["x", 1]  # the live replacement's own claim
    assert ep.claim() is None
    assert steps.claim(nxt) is None
    ep.close()


async def test_install_validates_every_record_before_installing_any() -> None:
    good = Record("a", {"boundary": {"next": "x"}, "step": 0})
    bad_records: list[list[Record]] = [
        [good, Record("b", {"step": 0})],
        [good, Record("b", {"boundary": None, "step": -1})],
        [good, Record("b", {"boundary": None, "step": True})],
        [good, Record("-bad", {"boundary": None, "step": 0})],
        [good, Record("b", {"boundary": {1, 2}, "step": 0})],
        [good, Record("a-a1", {"boundary": None, "step": 0})],  # rollout twice
    ]
    for records in bad_records:
        steps = EpisodeSteps()
        with pytest.raises(InvalidCheckpointState):
            steps.install(records)
        assert steps.restored_ids() == []
        assert steps.fresh()
    steps = EpisodeSteps()
    steps.begin(EpisodeId("live")).close()
    with pytest.raises(InvalidPhase):
        steps.install([good])


async def test_a_restart_is_marked_only_while_open_and_never_blocks() -> None:
    steps = EpisodeSteps()
    a = steps.begin(EpisodeId("a"), boundary={"n": 1})
    b = steps.begin(EpisodeId("b"))
    b.mark_restart()
    with pytest.raises(InvalidPhase):
        steps.export(None)  # admission open: boundaries still move
    steps.close_admission()
    with pytest.raises(InvalidPhase):
        a.mark_restart()
    assert not steps.ready()  # `a` runs outside any step
    report = steps.report(10)
    assert [x.key for x in report.blockers] == ["a"]
    assert report.restarts == ["b"]
    a.close()
    assert steps.ready()
    assert steps.export(None) == []
    b.close()


async def test_export_keeps_unclaimed_restores_and_refuses_restarts_in_scope() -> None:
    clock = ManualClock()
    steps = EpisodeSteps(clock=clock)
    steps.install(
        [
            Record("old", {"boundary": "b", "step": 2, "extra": [1]}),
            Record("gone", {"boundary": None, "step": 0}),
        ]
    )
    steps.open_admission()
    restart = steps.begin(EpisodeId("x"))
    restart.mark_restart()
    steps.close_admission()
    assert steps.ready()
    assert steps.report(10).restarts == ["x"]
    # The restart never parks either.
    async with restart.step("wait"):
        pass
    assert steps.export(None) == [
        Record("gone-a1", {"boundary": None, "step": 0}),
        Record("old-a1", {"boundary": "b", "step": 2, "extra": [1]}),
    ]
    scope = [EpisodeId("old", 1), EpisodeId("elsewhere")]
    assert [r.key for r in steps.export(scope)] == ["old-a1"]
    with pytest.raises(RestartInScope):
        steps.export([EpisodeId("x")])
    assert steps.delete_restored([EpisodeId("old", 1)]) == ["gone-a1"]
    assert steps.restored_ids() == [EpisodeId("old", 1)]
    restart.close()


async def test_report_lists_at_most_limit_blockers_but_counts_all() -> None:
    steps = EpisodeSteps(clock=ManualClock())
    eps = [steps.begin(EpisodeId(f"r{i:02d}")) for i in range(7)]
    steps.close_admission()
    report = steps.report(3)
    assert report.blocker_count == 7
    assert not report.ready
    assert [b.key for b in report.blockers] == ["r00", "r01", "r02"]
    assert report.counts == {"running": 7}
    for ep in eps:
        ep.close()
    assert steps.report(3).ready


async def test_a_result_is_not_delivered_while_the_checkpoint_is_closed() -> None:
    steps = EpisodeSteps()
    steps.install([Record("r1", {"boundary": {"next": "return", "reward": 0.5}, "step": 2})])
    steps.close_admission()

    async def replacement() -> Any:
        async with steps.begin(EpisodeId("r1", 1)) as ep:
            return ep.claim()["reward"]

    task = asyncio.create_task(replacement())
    await until(lambda: steps.report(5).counts == {"parked": 1})
    # Exported at its last boundary: a crash now continues it, so it must wait.
    assert [r.key for r in steps.export(None)] == ["r1-a1"]
    await asyncio.sleep(0.01)
    assert not task.done()
    steps.open_admission()
    assert await task == 0.5
    assert steps.live_executions() == 0


async def test_a_failing_replay_step_stays_parked_while_the_checkpoint_is_closed() -> None:
    steps = EpisodeSteps()
    fail = asyncio.Event()

    async def handler() -> None:
        async with steps.begin(R1, boundary={"next": "verify"}) as ep, ep.step("replay") as step:
            await fail.wait()
            step.boundary({"never": "recorded"})
            raise RuntimeError("judge unavailable")

    task = asyncio.create_task(handler())
    await until(lambda: steps.report(5).counts == {"replay_step": 1})
    steps.close_admission()
    fail.set()
    await until(lambda: steps.report(5).counts == {"parked": 1})
    assert steps.ready()  # readiness does not regress under a prepared checkpoint
    assert steps.export(None) == [Record("r1", {"boundary": {"next": "verify"}, "step": 0})]
    steps.open_admission()
    with pytest.raises(RuntimeError, match="judge unavailable"):
        await task
    assert steps.live_executions() == 0


async def test_begin_refuses_duplicates_and_superseded_attempts() -> None:
    steps = EpisodeSteps()
    ep = steps.begin(EpisodeId("r", 2))
    with pytest.raises(CheckpointError) as info:
        steps.begin(EpisodeId("r", 2))
    assert info.value.code == "invalid_request"
    with pytest.raises(StaleAttempt):
        steps.begin(EpisodeId("r", 1))
    with pytest.raises(CheckpointError):
        steps.begin(EpisodeId("q"), deadline_s=0)
    with pytest.raises(CheckpointError):
        ep.step("sometimes")  # type: ignore[arg-type]
    async with ep.step("wait"):
        with pytest.raises(CheckpointError):
            ep.step("wait")
    ep.close()
    assert not steps.fresh()
    steps.begin(EpisodeId("r", 1)).close()  # nothing newer is left once r-a2 ends

    restored = EpisodeSteps()
    restored.install([Record("r", {"boundary": None, "step": 0})])
    with pytest.raises(StaleAttempt):
        restored.begin(EpisodeId("r"))
    assert restored.delete_restored([]) == ["r-a1"]
    restored.begin(EpisodeId("r")).close()
