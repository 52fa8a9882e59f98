"""One live episode attempt: its steps, its boundary, its deadline.

A handler opens an episode with `EpisodeSteps.begin`, runs each step under
`async with episode.step(mode=..., name=...) as step`, and records the
boundary reached by the step inside the block (`step.boundary(state)`), so the
boundary and the step's completion are one event.  Both ends of a step are
park points: while admission is closed a step does not start, and a step that
completes does not let the handler proceed (or return its result) until
admission reopens.
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType
from typing import Any, Protocol

from ray_ckpt.clock import Clock
from ray_ckpt.errors import InvalidPhase, InvalidRequest
from ray_ckpt.identity import EpisodeId
from ray_ckpt.steps.modes import EpisodeState, EpisodeTimeout, StepMode, StepModeLike, step_mode

_UNSET: Any = object()


class StepOwner(Protocol):
    """What an episode needs from the table that owns it (`EpisodeSteps`).

    A protocol, so this module owns the episode types and the table depends
    on them, never the other way round.
    """

    clock: Clock

    async def _enter_step(self, ep: Episode, step: Step) -> None: ...

    async def _exit_step(self, ep: Episode, step: Step, *, error: BaseException | None) -> None: ...

    async def _park(self, ep: Episode) -> None: ...

    def _mark_restart(self, ep: Episode) -> None: ...

    def _moved(self, ep: Episode) -> None: ...

    def _free(self, ep: Episode, *, completed: bool) -> None: ...


class Restored:
    """A restored boundary waiting for (or handed to) its replacement attempt.

    The entry stays installed until its replacement records a boundary of its
    own (or completes): a replacement that is refused or fails first leaves it
    exactly as installed, so the next correct continuation still starts here.
    """

    __slots__ = ("boundary", "claimed", "spent_s", "state", "step_index")

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state  # the record's state, re-exported as is until moved on
        self.boundary: Any = state["boundary"]
        self.step_index: int = state["step"]
        # Deadline seconds the earlier attempts already used: a continuation
        # goes on with the budget that was left, never a fresh full one.
        self.spent_s: float = float(state.get("spent_s", 0.0))
        self.claimed = False


class Step:
    """One step of an episode; an async context manager."""

    def __init__(self, episode: Episode, mode: StepMode, name: str) -> None:
        self.episode = episode
        self.mode = mode
        self.name = name
        self.index = episode.step_index
        self.started: float | None = None
        self._pending: Any = _UNSET

    def boundary(self, state: Any) -> None:
        """Record the boundary this step reaches (JSON data naming the next step)."""
        self._pending = state

    @property
    def recorded(self) -> bool:
        return self._pending is not _UNSET

    async def __aenter__(self) -> Step:
        await self.episode._steps._enter_step(self.episode, self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.episode._steps._exit_step(self.episode, self, error=exc)


class Episode:
    """A live episode attempt, bound to the asyncio task that began it."""

    def __init__(
        self,
        steps: StepOwner,
        episode_id: EpisodeId,
        *,
        deadline_s: float | None,
        boundary: Any,
        step_index: int,
        restored: Restored | None,
        task: asyncio.Task[Any] | None,
        now: float,
    ) -> None:
        self._steps = steps
        self.id = episode_id
        self.key = episode_id.capture_key
        self.deadline_s = deadline_s
        self.task = task
        self.state = EpisodeState.RUNNING
        self.since = now  # when the current state began
        self.step_index = step_index  # completed steps; the next step's index
        self.current: Step | None = None
        self.restart = False
        self.retire_requested = False
        self.park_cancelled = False  # cancelled (not by its deadline): never park again
        self.deadline_fired = False  # its own DeadlineScope cancelled it
        self.closed = False
        self._boundary = boundary
        self._held: Any = _UNSET  # a replay step's boundary, held until reopen
        self._restored = restored
        # True while this attempt still stands on its restored entry (it has
        # recorded no boundary of its own yet).
        self.on_restored = restored is not None
        # A wait step ended without recording a boundary: until the next
        # park point the exported boundary may be behind the step's effects.
        self.unrecorded_wait: str | None = None
        self._spent_before = restored.spent_s if restored is not None else 0.0
        self._started = now
        self._paused_since: float | None = None
        self._paused_total = 0.0

    # --- boundaries ----------------------------------------------------------

    @property
    def boundary_state(self) -> Any:
        """The boundary a checkpoint exports for this episode right now."""
        return self._boundary

    def boundary(self, state: Any) -> None:
        """Record a boundary: inside a step, the one the step reaches."""
        if self.current is not None:
            self.current.boundary(state)
        else:
            self._boundary = state
            self.unrecorded_wait = None
            self._steps._moved(self)

    def claim(self) -> Any:
        """The restored boundary, handed over exactly once (else None)."""
        restored = self._restored
        if restored is None or restored.claimed:
            return None
        restored.claimed = True
        return restored.boundary

    @property
    def restored(self) -> bool:
        return self._restored is not None

    def step(self, mode: StepModeLike = StepMode.WAIT, name: str = "") -> Step:
        if self.current is not None:
            raise InvalidRequest(f"episode {self.key}: step {self.current.name!r} is still open")
        return Step(self, step_mode(mode), name or f"step-{self.step_index}")

    def mark_restart(self) -> None:
        """This episode cannot be captured: it never blocks, parks or exports.

        Only while no checkpoint is open, so a checkpoint's export and restart
        sets cannot change under it.
        """
        self._steps._mark_restart(self)

    # --- time ------------------------------------------------------------------

    def parked_s(self) -> float:
        """Seconds this episode has spent parked for checkpoints."""
        now = self._steps.clock.now()
        open_interval = now - self._paused_since if self._paused_since is not None else 0.0
        return self._paused_total + open_interval

    def elapsed(self) -> float:
        """Seconds charged against the deadline: wall time minus parked time,
        plus what the earlier attempts of a restored episode used."""
        return self._spent_before + self._steps.clock.now() - self._started - self.parked_s()

    def remaining(self) -> float:
        """Seconds left of the deadline (parked time excluded); inf without one."""
        if self.deadline_s is None:
            return math.inf
        return max(0.0, self.deadline_s - self.elapsed())

    @property
    def paused(self) -> bool:
        return self._paused_since is not None

    def _sync_pause(self, admission_open: bool, now: float) -> None:
        # Parked, or in a replay step the closed checkpoint does not wait for:
        # either way the episode is held for the checkpoint, not working late.
        # A restart never parks here, but every call it makes downstream waits
        # at a closed gate (agent activation, model admission, resources
        # enter); the environment closes first and reopens last, so its
        # closed window covers every downstream one and is not charged.
        if self.restart:
            paused = not admission_open
        else:
            paused = self.state is EpisodeState.PARKED or (
                self.state is EpisodeState.REPLAY_STEP and not admission_open
            )
        if paused and self._paused_since is None:
            self._paused_since = now
        elif not paused and self._paused_since is not None:
            self._paused_total += now - self._paused_since
            self._paused_since = None

    def deadline(self, *, poll_s: float = 0.5) -> DeadlineScope:
        """An async context that raises `EpisodeTimeout` when the budget runs out."""
        return DeadlineScope(self, poll_s)

    # --- lifetime --------------------------------------------------------------

    def close(self) -> None:
        """End the episode and free its state now (idempotent).

        An attempt that never moved past its restored boundary leaves the
        restored entry installed (claimable, exported, fenced) for the next
        continuation.
        """
        self._steps._free(self, completed=False)

    async def finish(self, *, completed: bool = True) -> None:
        """End the episode at a park point, then free it.

        While admission is closed the episode may already be exported at its
        last boundary, so no outcome (result or failure) may leave before
        reopen: either the checkpoint continues it or the caller gets it,
        never both.
        """
        try:
            await self._steps._park(self)
        finally:
            self._steps._free(self, completed=completed)

    async def __aenter__(self) -> Episode:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A failure is an outcome too: it waits at the park point like a
        # result (a retire's cancel does not wait: `_park` lets it through).
        await self.finish(completed=exc_type is None)

    def __repr__(self) -> str:
        return f"Episode({self.key}, {self.state.value}, step={self.step_index})"


class DeadlineScope:
    """Cancel the enclosing task when the episode's non-parked budget runs out.

    The budget is read from the injected clock, so the check polls (at most
    every `poll_s` real seconds) instead of trusting the loop's timer.
    """

    def __init__(self, episode: Episode, poll_s: float) -> None:
        if poll_s <= 0:
            raise InvalidRequest("poll_s must be > 0")
        self._episode = episode
        self._poll_s = poll_s
        self._task: asyncio.Task[Any] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._cancelling = 0
        self._fired = False

    async def __aenter__(self) -> DeadlineScope:
        task = asyncio.current_task()
        if task is None:
            raise InvalidPhase("an episode deadline needs a running task")
        if self._episode.remaining() <= 0:
            raise EpisodeTimeout(f"episode {self._episode.key} ran out of time")
        self._task = task
        self._cancelling = task.cancelling()
        self._schedule()
        return self

    def _schedule(self) -> None:
        delay = min(self._poll_s, self._episode.remaining())
        self._handle = asyncio.get_running_loop().call_later(delay, self._check)

    def _check(self) -> None:
        self._handle = None
        if self._episode.remaining() > 0:
            self._schedule()
        elif self._task is not None and not self._task.done():
            self._fired = True
            self._episode.deadline_fired = True
            self._task.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        # Undo only our own cancel; a retire's cancel must still propagate.
        if (
            self._fired
            and self._task is not None
            and self._task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise EpisodeTimeout(
                f"episode {self._episode.key} ran out of its {self._episode.deadline_s}s deadline"
            ) from exc
