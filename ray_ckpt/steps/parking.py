"""The park points: what a step's start and end do while a checkpoint is closed.

Both ends of a step, and the end of an episode, are park points: while
admission is closed the episode waits there, at its boundary, so a prepared
participant stays ready and no outcome leaves that a checkpoint also
continues.  These rules (which failure parks, when a replay step's boundary
takes effect, what a cancel does) are the subtle part of the steps table and
read best in one place; the table (`table.py`) keeps the bookkeeping they
call (`_transition`, the restored entries) and forwards its `StepOwner`
hooks here.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ray_ckpt.errors import InvalidPhase, InvalidRequest
from ray_ckpt.steps.episode import _UNSET, Episode, Step
from ray_ckpt.steps.modes import EpisodeState, StepMode

if TYPE_CHECKING:
    from ray_ckpt.steps.table import EpisodeSteps

_STEP_STATE = {StepMode.WAIT: EpisodeState.WAIT_STEP, StepMode.REPLAY: EpisodeState.REPLAY_STEP}


async def enter_step(steps: EpisodeSteps, ep: Episode, step: Step) -> None:
    if ep.closed:
        raise InvalidPhase(f"episode {ep.key} is closed")
    if ep.current is not None:
        raise InvalidRequest(f"episode {ep.key}: step {ep.current.name!r} is still open")
    ep.current = step
    try:
        await park(steps, ep)
    except BaseException:
        ep.current = None
        if steps.admission_open or ep.retire_requested:
            steps._transition(ep, EpisodeState.RUNNING)
        # else: interrupted while parked under a closed checkpoint; it is
        # still at its boundary, and the episode's end parks again.
        raise
    ep.unrecorded_wait = None  # the episode reached this step's start
    step.started = steps.clock.now()
    steps._transition(ep, _STEP_STATE[step.mode])


async def exit_step(
    steps: EpisodeSteps, ep: Episode, step: Step, *, error: BaseException | None
) -> None:
    ep.current = None
    if ep.closed:
        return
    if error is not None:
        # The step's effects are unknown: keep the boundary before it.
        if isinstance(error, asyncio.CancelledError) and not ep.deadline_fired:
            # A cancel that is not the episode's own deadline (shutdown, a
            # dropped caller; a retire is let through by `park` anyway)
            # must end the task, so it never parks; but under a closed
            # checkpoint the episode stays at its boundary, so a prepared
            # participant does not turn unready on the way out.
            ep.park_cancelled = True
            state = EpisodeState.RUNNING if steps.admission_open else EpisodeState.PARKED
            steps._transition(ep, state)
            return
        # Any other failure (the deadline inside a wait step included) is
        # an outcome: it waits here, parked at that boundary, until
        # admission reopens, so a prepared participant stays ready and the
        # caller never holds a failure for an episode a checkpoint also
        # continues.
        try:
            await park(steps, ep)
        finally:
            steps._transition(ep, EpisodeState.RUNNING)
        return
    if step.recorded:
        ep.unrecorded_wait = None
        if step.mode is StepMode.REPLAY and not steps.admission_open and not ep.restart:
            # The closed checkpoint counts this episode as parked before the
            # step; the step's boundary takes effect only once it reopens.
            ep._held = step._pending
        else:
            _record(steps, ep, step._pending, step.index + 1)
    elif step.mode is StepMode.WAIT and not ep.restart:
        # A wait step that recorded no boundary may still be followed by
        # `ep.boundary(...)` outside it (misuse): the boundary before the
        # step is then not safe to export.  Do not park here; the closed
        # checkpoint keeps waiting for the next park point (the next step
        # or the end), by when any boundary the step reached is recorded.
        ep.unrecorded_wait = step.name
        steps._transition(ep, EpisodeState.RUNNING)
        return
    try:
        # A step that records no boundary leaves the episode where it was.
        await park(steps, ep)
    finally:
        if ep._held is not _UNSET and steps.admission_open:
            held, ep._held = ep._held, _UNSET
            _record(steps, ep, held, step.index + 1)
        steps._transition(ep, EpisodeState.RUNNING)


def _record(steps: EpisodeSteps, ep: Episode, boundary: Any, step_index: int) -> None:
    ep._boundary = boundary
    ep.step_index = step_index
    steps._moved(ep)


async def park(steps: EpisodeSteps, ep: Episode) -> None:
    if ep.restart or ep.closed or ep.retire_requested or ep.park_cancelled or steps.admission_open:
        return
    steps._transition(ep, EpisodeState.PARKED)
    # A checkpoint that closes again before the episode wakes keeps it parked.
    try:
        while not steps.admission_open:
            await steps._opened.wait()
    except asyncio.CancelledError:
        # Cancelled while parked (shutdown, a dropped caller): stop parking,
        # or the cancel would be swallowed by the next park point.  If
        # the episode then ends, a commit naming it fails (`EpisodeNotHeld`).
        ep.park_cancelled = True
        raise
