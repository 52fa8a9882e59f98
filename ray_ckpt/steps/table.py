"""`EpisodeSteps`: one Gym server's live episodes, admission, park points, retire.

The engine closes admission at prepare and reopens it at resume; between
the two, every episode must be at a boundary (parked, or inside a replay step)
for the checkpoint to be ready.  Exported records carry the boundary and the
index of the next step; a restore installs them under attempt + 1 where the
replacement attempt claims its boundary exactly once.

One object, one module: the live-episode table and its bookkeeping
(admission, begin, state counts, free, notify), the park-point rules its
`StepOwner` hooks apply (which failure parks, when a replay step's boundary
takes effect, what a cancel does), and retire, the one operation that owns
other tasks' lifetimes.  What stands on its own is apart, behind narrow
interfaces that never import the table: the episode types (`episode`), the
restored entries and the closed window's losses (`restored`), the attempt
index (`attempts`), retire's marks and scope (`retire_marks`), export and
the prepare report (`persist`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from ray_ckpt.clock import SYSTEM_CLOCK, Clock
from ray_ckpt.errors import AdmissionClosed, InvalidPhase, InvalidRequest, StaleAttempt
from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import MAX_REPORTED_BLOCKERS, PrepareReport
from ray_ckpt.steps.attempts import AttemptIndex
from ray_ckpt.steps.episode import _UNSET, Episode, Step
from ray_ckpt.steps.modes import BLOCKING, EpisodeState, StepMode
from ray_ckpt.steps.persist import build_report, export_records
from ray_ckpt.steps.restored import RestoredEntries
from ray_ckpt.steps.retire_marks import retire_scope
from ray_ckpt.storage.records.record import Record

log = logging.getLogger(__name__)

_STEP_STATE = {StepMode.WAIT: EpisodeState.WAIT_STEP, StepMode.REPLAY: EpisodeState.REPLAY_STEP}


class EpisodeSteps:
    """Tracks one server's live and restored episodes.  Not thread-safe: one loop."""

    def __init__(self, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self._live: dict[EpisodeId, Episode] = {}
        self._counts: Counter[EpisodeState] = Counter()
        self._attempts = AttemptIndex()  # live and restored, for supersession
        self._restored = RestoredEntries(self._attempts)
        self._open = True
        self._opened = asyncio.Event()
        self._opened.set()
        self._served = False
        self._notify: Callable[[], None] | None = None

    # --- engine side -------------------------------------------------------

    def bind(self, notify: Callable[[], None]) -> None:
        self._notify = notify

    @property
    def admission_open(self) -> bool:
        return self._open

    def close_admission(self) -> None:
        """Idempotent.  Steps not yet started wait; replay steps stop the clock."""
        if self._open:
            self._restored.window_closed(self._live)
        self._open = False
        self._opened.clear()
        self._resync_pauses()
        self._changed()

    def open_admission(self) -> None:
        """Idempotent.  Parked episodes wake and continue."""
        self._open = True
        self._opened.set()
        self._resync_pauses()
        self._changed()

    def ready(self) -> bool:
        """Cheap: no live episode is running outside a boundary."""
        return not any(self._counts[s] for s in BLOCKING)

    def fresh(self) -> bool:
        """True until the first episode begins (a restore needs a fresh table)."""
        return not self._served

    def live_executions(self) -> int:
        return len(self._live)

    def episodes(self) -> list[Episode]:
        return list(self._live.values())

    def restored_ids(self) -> list[EpisodeId]:
        """Restored episodes whose replacement has not begun, by that attempt."""
        return self._restored.waiting(self._live)

    def report(self, limit: int = MAX_REPORTED_BLOCKERS) -> PrepareReport:
        waiting = self._restored.waiting_count(self._live)
        return build_report(self._live.values(), self._counts, waiting, limit, self.clock.now())

    # --- handler side ----------------------------------------------------------

    def begin(
        self,
        episode_id: EpisodeId,
        *,
        deadline_s: float | None = None,
        boundary: Any = None,
        expect: Callable[[Any], None] | None = None,
    ) -> Episode:
        """Open an episode attempt bound to the current task.

        While admission is closed only the replacement of a restored episode
        may begin; it starts at the restored boundary (which wins over
        `boundary`) and is exported as such until it moves on.  `expect` is
        called with a restored boundary before anything changes and refuses a
        mismatched continuation by raising (a `CheckpointError`, typically
        `InvalidRequest`); the restored entry then stays exactly as installed.
        """
        if deadline_s is not None and not deadline_s > 0:
            raise InvalidRequest(f"deadline_s must be > 0, got {deadline_s!r}")
        self._check_attempt(episode_id)
        restored = self._restored.get(episode_id)
        if restored is None and not self._open:
            raise AdmissionClosed(f"episode {episode_id}: a checkpoint is in progress")
        if restored is not None and expect is not None:
            expect(restored.boundary)
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        if restored is not None:
            # Not removed: it stays installed until the replacement moves on.
            restored.claimed = False
            boundary = restored.boundary
        ep = Episode(
            self,
            episode_id,
            deadline_s=deadline_s,
            boundary=boundary,
            step_index=restored.step_index if restored is not None else 0,
            restored=restored,
            task=task,
            now=self.clock.now(),
        )
        self._served = True
        self._live[episode_id] = ep
        if not self._open:
            self._restored.served(episode_id)
        if restored is None:  # a replacement shares its restored entry's slot
            self._attempts.add(episode_id)
        self._counts[ep.state] += 1
        self._changed()
        return ep

    def _check_attempt(self, episode_id: EpisodeId) -> None:
        current = self._live.get(episode_id)
        if current is not None:
            if current.retire_requested:
                raise StaleAttempt(f"episode {episode_id} is being retired")
            raise InvalidRequest(f"episode {episode_id} is already live")
        newest = self._attempts.newest(episode_id.rollout_id)
        if newest > episode_id.attempt:
            raise StaleAttempt(f"episode {episode_id}: attempt {newest} supersedes it")

    def claim(self, episode_id: EpisodeId) -> Any:
        """Hand a restored boundary to the live replacement attempt, exactly once.

        Only a live attempt is handed anything: before the replacement begins
        this returns None and changes nothing, so the boundary its handler
        starts from is always the one it exports.
        """
        ep = self._live.get(episode_id)
        return ep.claim() if ep is not None else None

    # --- park points (the `StepOwner` hooks an episode calls) -------------------
    #
    # Both ends of a step, and the end of an episode, are park points: while
    # admission is closed the episode waits there, at its boundary, so a
    # prepared participant stays ready and no outcome leaves that a
    # checkpoint also continues.

    async def _enter_step(self, ep: Episode, step: Step) -> None:
        if ep.closed:
            raise InvalidPhase(f"episode {ep.key} is closed")
        if ep.current is not None:
            raise InvalidRequest(f"episode {ep.key}: step {ep.current.name!r} is still open")
        ep.current = step
        try:
            await self._park(ep)
        except BaseException:
            ep.current = None
            if self._open or ep.retire_requested:
                self._transition(ep, EpisodeState.RUNNING)
            # else: interrupted while parked under a closed checkpoint; it is
            # still at its boundary, and the episode's end parks again.
            raise
        ep.unrecorded_wait = None  # the episode reached this step's start
        step.started = self.clock.now()
        self._transition(ep, _STEP_STATE[step.mode])

    async def _exit_step(self, ep: Episode, step: Step, *, error: BaseException | None) -> None:
        ep.current = None
        if ep.closed:
            return
        if error is not None:
            # The step's effects are unknown: keep the boundary before it.
            if isinstance(error, asyncio.CancelledError) and not ep.deadline_fired:
                # A cancel that is not the episode's own deadline (shutdown, a
                # dropped caller; a retire is let through by `_park` anyway)
                # must end the task, so it never parks; but under a closed
                # checkpoint the episode stays at its boundary, so a prepared
                # participant does not turn unready on the way out.
                ep.park_cancelled = True
                state = EpisodeState.RUNNING if self._open else EpisodeState.PARKED
                self._transition(ep, state)
                return
            # Any other failure (the deadline inside a wait step included) is
            # an outcome: it waits here, parked at that boundary, until
            # admission reopens, so a prepared participant stays ready and the
            # caller never holds a failure for an episode a checkpoint also
            # continues.
            try:
                await self._park(ep)
            finally:
                self._transition(ep, EpisodeState.RUNNING)
            return
        if step.recorded:
            ep.unrecorded_wait = None
            if step.mode is StepMode.REPLAY and not self._open and not ep.restart:
                # The closed checkpoint counts this episode as parked before the
                # step; the step's boundary takes effect only once it reopens.
                ep._held = step._pending
            else:
                self._record(ep, step._pending, step.index + 1)
        elif step.mode is StepMode.WAIT and not ep.restart:
            # A wait step that recorded no boundary may still be followed by
            # `ep.boundary(...)` outside it (misuse): the boundary before the
            # step is then not safe to export.  Do not park here; the closed
            # checkpoint keeps waiting for the next park point (the next step
            # or the end), by when any boundary the step reached is recorded.
            ep.unrecorded_wait = step.name
            self._transition(ep, EpisodeState.RUNNING)
            return
        try:
            # A step that records no boundary leaves the episode where it was.
            await self._park(ep)
        finally:
            if ep._held is not _UNSET and self._open:
                held, ep._held = ep._held, _UNSET
                self._record(ep, held, step.index + 1)
            self._transition(ep, EpisodeState.RUNNING)

    def _record(self, ep: Episode, boundary: Any, step_index: int) -> None:
        ep._boundary = boundary
        ep.step_index = step_index
        self._moved(ep)

    async def _park(self, ep: Episode) -> None:
        if ep.restart or ep.closed or ep.retire_requested or ep.park_cancelled or self._open:
            return
        self._transition(ep, EpisodeState.PARKED)
        # A checkpoint that closes again before the episode wakes keeps it parked.
        try:
            while not self._open:
                await self._opened.wait()
        except asyncio.CancelledError:
            # Cancelled while parked (shutdown, a dropped caller): stop parking,
            # or the cancel would be swallowed by the next park point.  If
            # the episode then ends, a commit naming it fails (`EpisodeNotHeld`).
            ep.park_cancelled = True
            raise

    def _moved(self, ep: Episode) -> None:
        """The episode recorded a boundary of its own: its restored entry is spent."""
        self._restored.spend(ep)

    def _mark_restart(self, ep: Episode) -> None:
        if not self._open:
            raise InvalidPhase(f"episode {ep.key}: restart only while no checkpoint is open")
        if ep.closed or ep.restart:
            return
        ep.restart = True
        self._transition(ep, EpisodeState.RESTART)

    # --- export and restore ----------------------------------------------------

    def export(
        self, scope: Sequence[EpisodeId] | None, *, require_held: bool = False
    ) -> list[Record]:
        """Records for the episodes in scope (all capturable ones when None).

        Needs closed admission and every exported episode at a boundary.
        Restored episodes whose replacement has not begun are included (named
        by the replacement attempt), so a second crash still continues them.
        With `require_held` (a server whose episodes are its only state), a
        scope naming an episode that was live here during this closed window
        but has ended (and was not retired) raises `EpisodeNotHeld`: its
        capture is lost and the kinds would disagree about what was captured.
        A server that keeps state beyond the episode (the agent's sessions)
        leaves it off.
        """
        if self._open:
            raise InvalidPhase("export needs admission closed")
        if scope is not None and require_held:
            self._restored.check_held(scope, self._live)
        return export_records(self._live, self._restored.entries, scope)

    def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        """Validate every record, then install each under attempt + 1."""
        if self._served or self._live:
            raise InvalidPhase("install needs an EpisodeSteps that has served no episode")
        staged = self._restored.install(records)
        self._changed()
        return staged

    def delete_restored(self, keep: Sequence[EpisodeId]) -> list[str]:
        """Free restored-but-unclaimed state not named in `keep`."""
        freed = self._restored.delete(keep, self._live)
        if freed:
            self._changed()
        return freed

    # --- retire ----------------------------------------------------------------

    def retiring(self) -> int:
        """Attempts a retire is stopping right now."""
        return self._counts[EpisodeState.RETIRING]

    async def retire(self, episode_ids: Sequence[EpisodeId]) -> list[str]:
        """Stop every attempt <= the given one of each rollout, wait, free.

        Each attempt's task is cancelled once (a second cancel would interrupt
        its cleanup) and awaited, so its `finally:` blocks have run when this
        returns.  If this call is itself cancelled (a control deadline), the
        attempts keep stopping and stay blockers in state `retiring` until
        they do, freed from their task's done callback; a later retire waits
        for them again.  Returns capture keys.
        """
        covered = retire_scope(episode_ids)

        keys = self._restored.retire(covered, self._live)
        me = asyncio.current_task()
        stopping: set[asyncio.Task[Any]] = set()
        for ep in [ep for eid, ep in self._live.items() if covered(eid)]:
            keys.add(ep.key)
            if not self._open:
                self._restored.retired(ep.id)
            task = ep.task
            if task is None or task.done() or task is me:
                self._free(ep, completed=False)
                continue
            if not ep.retire_requested:
                ep.retire_requested = True
                self._transition(ep, EpisodeState.RETIRING)
                # Freed when the task ends, even if this retire is cancelled first.
                task.add_done_callback(functools.partial(self._stopped, ep))
                task.cancel()
            stopping.add(task)
        if keys:
            self._changed()
        if stopping:
            # asyncio.wait, not gather: cancelling us must not cancel them again.
            await asyncio.wait(stopping)
        return sorted(keys)

    def _stopped(self, ep: Episode, _task: asyncio.Task[Any]) -> None:
        self._free(ep, completed=False)

    # --- bookkeeping -----------------------------------------------------------

    def _transition(self, ep: Episode, state: EpisodeState) -> None:
        if ep.retire_requested and state is not EpisodeState.RETIRING:
            state = EpisodeState.RETIRING  # sticky until the task has stopped
        elif ep.restart and state is not EpisodeState.RETIRING:
            state = EpisodeState.RESTART
        if ep.closed or state is ep.state:
            return
        self._counts[ep.state] -= 1
        self._counts[state] += 1
        ep.state = state
        now = self.clock.now()
        ep.since = now
        ep._sync_pause(self._open, now)
        self._changed()

    def _resync_pauses(self) -> None:
        now = self.clock.now()
        for ep in self._live.values():
            ep._sync_pause(self._open, now)

    def _free(self, ep: Episode, *, completed: bool) -> None:
        if ep.closed:
            return
        ep._sync_pause(True, self.clock.now())
        ep.closed = True
        if ep.on_restored and completed:
            # Its outcome left from the restored boundary: the entry is spent.
            self._moved(ep)
        if self._live.get(ep.id) is ep:
            del self._live[ep.id]
            self._counts[ep.state] -= 1
            restored = ep._restored
            if restored is not None and self._restored.holds(ep):
                # Refused or failed before a boundary of its own: the restored
                # entry stays installed, fenced and claimable.
                restored.claimed = False
            else:
                self._attempts.remove(ep.id)
        self._changed()

    def _changed(self) -> None:
        if self._notify is None:
            return
        try:
            self._notify()
        except Exception:  # a broken callback must not break a data-plane handler
            log.exception("episode steps: notify callback failed")
