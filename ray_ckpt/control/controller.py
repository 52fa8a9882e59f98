"""The participant controller: one per Gym server, transport-agnostic.

It owns the pure phase machine (`ray_ckpt.control.phase_machine`), the retire
marks and the lock, and carries out what the machine decides on the
participant hooks.  The HTTP routes and the Ray actor methods both call
`handle()`, so every transport drives the same code.

Each operation's order of steps (admission of the call, phase transitions,
replies cached for retries) reads here, except commit's and restore's: their
work outlives the call (shielded, finished by a retry), and that shared shape
reads in `shielded`.  The work of the steps lives in sibling modules:
`commit` (the write-once export and its store write), `restore` (the
once-per-process read and install) and `timing` (the call deadline, the
readiness wait and the lease watcher).  They read this controller's
attributes at call time, so replacing one (a test swaps `store`) reaches them
too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections import Counter
from typing import Any

from ray_ckpt.clock import SYSTEM_CLOCK, Clock
from ray_ckpt.control import receipt_ops, shielded
from ray_ckpt.control.background import BackgroundWrites
from ray_ckpt.control.commit import Commits, Write
from ray_ckpt.control.observer import ControlObserver
from ray_ckpt.control.phase_machine import ControlState, Effect, Event, Phase, Transition
from ray_ckpt.control.protocol import Participant
from ray_ckpt.control.restore import Restores
from ray_ckpt.control.retire_marks import RetiredAttempts
from ray_ckpt.control.timing import LeaseWatcher, ReadinessWait, within
from ray_ckpt.control.wire import (
    MAX_REPORTED_BLOCKERS,
    RECEIPT_OPERATIONS,
    AckRequest,
    CheckpointRequest,
    CollectRequest,
    CommitRequest,
    ForgetRequest,
    RestoreRequest,
    ResumeRequest,
    RetireRequest,
    decode_receipt_request,
    decode_request,
    report_reply,
)
from ray_ckpt.errors import CheckpointConflict
from ray_ckpt.identity import EpisodeId
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage.seam import FileRecordStore, RecordStore

log = logging.getLogger(__name__)


class ParticipantController:
    def __init__(
        self,
        participant: Participant,
        *,
        instance: str,
        settings: CheckpointSettings,
        clock: Clock = SYSTEM_CLOCK,
        store: RecordStore | None = None,
    ) -> None:
        self.participant = participant
        self.kind = participant.kind
        self.instance = instance
        self.settings = settings
        self.clock = clock
        self.store: RecordStore = store or FileRecordStore(
            full_every=settings.incremental_full_every,
            min_live_fraction=settings.incremental_min_live_fraction,
        )
        self.state = ControlState()
        self.retired = RetiredAttempts()
        self._lock = asyncio.Lock()
        self._ready = ReadinessWait(self)
        # The commit writes under way, by checkpoint ID; a resume or lease expiry stops them.
        self._writes: dict[str, Write] = {}
        self._commits = Commits(self)
        self._restores = Restores(self)
        # The attempts named by the retires in flight (with repeats), for a
        # participant without a `retiring()` hook.
        self._retiring: Counter[EpisodeId] = Counter()
        self._lease = LeaseWatcher(self)
        # The asynchronous commit's write, running past its checkpoint's resume.
        self._background = BackgroundWrites()
        # Told of every call and lease expiry (the host's metrics); none off Ray.
        self.observer: ControlObserver | None = None
        # Which process answers: a server whose port several processes share,
        # each with a controller of its own, shows several (refused at
        # discovery, `ray_ckpt.workers.detect`).
        self.process_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        participant.bind(self.notify)

    # --- plumbing ----------------------------------------------------------
    def notify(self) -> None:
        """Participants call this whenever readiness may have changed."""
        self._ready.notify()

    def _renew(self, req: CheckpointRequest) -> None:
        self.state.renew(req.deadline_ts, self.settings.lease_grace_seconds)

    async def _apply(self, transition: Transition) -> None:
        for effect in transition.effects:
            if effect is Effect.CLOSE_ADMISSION:
                self.participant.close_admission()
            elif effect is Effect.OPEN_ADMISSION:
                self.participant.open_admission()
            elif effect is Effect.STOP_WRITES and transition.checkpoint_id is not None:
                write = self._writes.pop(transition.checkpoint_id, None)
                if write is not None:
                    await write.halt()
        self.notify()

    async def handle(self, op: str, body: bytes | dict[str, Any]) -> dict[str, Any]:
        """Decode, dispatch and answer one control call (any transport)."""
        if op == "status":
            return self.status()
        if self.observer is None:
            return await self._dispatch(op, body)
        start = self.clock.now()
        outcome = "failed"
        try:
            reply = await self._dispatch(op, body)
            outcome = "ok"
            return reply
        finally:
            self.observer.call_done(op, self.clock.now() - start, outcome, self.writes_in_flight)

    async def _dispatch(self, op: str, body: bytes | dict[str, Any]) -> dict[str, Any]:
        receipts = op in RECEIPT_OPERATIONS
        req = decode_receipt_request(op, body) if receipts else decode_request(op, body)
        handler = getattr(self, op)
        reply: dict[str, Any] = await handler(req)
        return reply

    @property
    def writes_in_flight(self) -> int:
        """Commit writes whose store write has not finished yet (an asynchronous
        commit's included, which outlives its checkpoint)."""
        running = sum(1 for w in self._writes.values() if w.task is not None and not w.task.done())
        return running + (1 if self._background.busy() is not None else 0)

    # --- status ------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "instance": self.instance,
            "phase": self.state.phase.value,
            "checkpoint_id": self.state.checkpoint_id,
            "lease_expires_at": self.state.lease_expires_at,
            "retired_rollouts": self.retired.retired_rollouts(),
            "retiring": self._retiring_now(),
            "live_executions": self.participant.live_executions(),
            # What a restore needs (`control.restore`): the coordinator checks
            # it before changing anything anywhere.
            "fresh": self.participant.fresh() and not self._restores.restored_once,
            "writes_in_flight": self.writes_in_flight,
            "background_write": self._background.status(),
            **receipt_ops.status_fields(self),
            "report": report_reply(self.participant.report(MAX_REPORTED_BLOCKERS)),
            "process": self.process_id,
        }

    def _retiring_now(self) -> int:
        """The attempts being stopped right now: the participant knows (a
        retire of `r` attempt 2 stops attempts 0-2, and stops that outlive a
        cancelled retire call go on); without its hook, the distinct attempts
        named by the retires in flight."""
        hook = getattr(self.participant, "retiring", None)
        if hook is not None:
            return int(hook())
        return len(self._retiring)

    # --- prepare -----------------------------------------------------------
    async def prepare(self, req: CheckpointRequest) -> dict[str, Any]:
        cid = req.checkpoint_id
        async with self._lock:
            cached = self.state.admit("prepare", cid)
            if cached is not None:
                return dict(cached)
            # No deadline check here: the deadline bounds only the wait, so
            # a ready participant answers `prepared` even past it (clock skew
            # between nodes must not fail a ready checkpoint), and one that
            # is not answers `preparing` with its blockers, admission closed.
            if self.state.phase is Phase.IDLE:
                transition = self.state.fire(Event.PREPARE, cid)
                try:
                    await self._apply(transition)
                except BaseException:
                    await self._apply(self.state.fire(Event.CLOSE_FAILED))
                    raise
            self._renew(req)
        # One captured copy at most: the previous asynchronous commit's write
        # ends before this checkpoint captures anything.
        busy = self._background.busy()
        if busy is not None and not await self._background.wait_idle(
            max(req.deadline_ts - self.clock.now(), 0.0)
        ):
            report = report_reply(self.participant.report(MAX_REPORTED_BLOCKERS))
            key = f"write-in-flight:{busy}"
            report["ready"] = False
            report["blockers"] = [key, *report["blockers"]]
            report["blocker_details"] = [
                {"key": key, "state": "writing"},
                *report["blocker_details"],
            ]
            report["blocker_count"] += 1
            # Answer for this ID only: a resume may have ended it during the
            # wait, and another checkpoint opened since.
            phase = self.state.phase if self.state.checkpoint_id == cid else Phase.IDLE
            return {"phase": phase.value, "report": report}
        # Wait outside the lock so a resume can interrupt this prepare.
        await self._ready.wait(req)
        async with self._lock:
            report = report_reply(self.participant.report(MAX_REPORTED_BLOCKERS))
            if self.state.checkpoint_id != cid:
                # A resume (or a lapsed lease) ended this checkpoint while we
                # waited: answer for this ID, not for one opened since.
                return {"phase": Phase.IDLE.value, "report": report}
            if self.state.phase is Phase.PREPARING and self.participant.ready():
                self.state.fire(Event.READY)
                report = report_reply(self.participant.report(MAX_REPORTED_BLOCKERS))
                reply = {"phase": Phase.PREPARED.value, "report": report}
                self.state.cache("prepare", cid, reply)
                return reply
            return {"phase": self.state.phase.value, "report": report}

    # --- renew ---------------------------------------------------------------
    async def renew(self, req: CheckpointRequest) -> dict[str, Any]:
        async with self._lock:
            self.state.admit("renew", req.checkpoint_id)
            req.remaining(self.clock.now())
            self._renew(req)
            return {"lease_expires_at": self.state.lease_expires_at}

    # --- commit and restore (their order of steps is in `shielded`) ------------
    async def commit(self, req: CommitRequest) -> dict[str, Any]:
        return await shielded.commit(self, req)

    async def restore(self, req: RestoreRequest) -> dict[str, Any]:
        return await shielded.restore(self, req)

    # --- resume --------------------------------------------------------------
    async def resume(self, req: ResumeRequest) -> dict[str, Any]:
        cid = req.checkpoint_id
        async with self._lock:
            if self.state.is_resumed(cid):
                if req.abort:
                    # Resumed already (its lease lapsed, say), now aborted:
                    # its write, if it still runs, is stopped.
                    await self._background.discard(cid)
                # For the ID resumed, whatever else has opened since.
                return {"phase": Phase.IDLE.value, "idempotent": True}
            active = self.state.checkpoint_id
            if active is not None and active != cid:
                raise CheckpointConflict(f"checkpoint {active} is open; resume of {cid} refused")
            if active is None:
                # The prepare never reached us: record the ID so it is refused
                # if it does.  Nothing was open, so nothing changed: idempotent.
                self.state.remember_resumed(cid)
                return {"phase": self.state.phase.value, "idempotent": True}
            if self.state.phase is Phase.RESTORED:
                await self._restores.installed()
                await self._restores.settle()
                # Installed state lost since (a worker died): the restore
                # fails whole; admission stays closed until its attempts are
                # retired or the lease lapses (they are fenced either way).
                self._restores.check_whole()
                self._restores.end()
            await self._apply(self.state.fire(Event.RESUME))
            if req.abort:
                # Never published: the captured write is dropped, not written.
                await self._background.discard(cid)
            else:
                self._background.release(cid)  # an asynchronous commit's write, now
            return {"phase": self.state.phase.value, "idempotent": False}

    # --- retire / forget -----------------------------------------------------
    async def retire(self, req: RetireRequest) -> dict[str, Any]:
        async with self._lock:
            self.state.admit("retire", req.checkpoint_id)
            req.remaining(self.clock.now())
            for episode in req.episode_ids:
                self.retired.mark(episode)
            if self.state.phase is Phase.RESTORED:
                self._renew(req)
            self._retiring.update(req.episode_ids)
        try:
            await within(self.clock, req, "install wait", self._restores.installed())
            keys = await within(self.clock, req, "retire", self.participant.retire(req.episode_ids))
        finally:
            self._retiring -= Counter(req.episode_ids)
            self.notify()
        return {"retired": sorted(keys)}

    async def forget(self, req: ForgetRequest) -> dict[str, Any]:
        async with self._lock:
            self.state.admit("forget", req.checkpoint_id)
            forgotten = self.retired.forget(req.rollout_ids)
            # Optional hook: a participant that keeps per-rollout state past
            # the episode (the policy model's ledger) frees it with the marks.
            hook = getattr(self.participant, "forget", None)
            if hook is not None:
                hook(list(req.rollout_ids))
            return {"forgotten": forgotten}

    # --- completion receipts (`receipt_ops`): no phase, no fence -------------------
    async def ack(self, req: AckRequest) -> dict[str, Any]:
        return await receipt_ops.ack(self, req)

    async def collect(self, req: CollectRequest) -> dict[str, Any]:
        return await receipt_ops.collect(self, req)

    # --- lease ---------------------------------------------------------------
    async def check_lease(self) -> bool:
        """Resume by itself if the controller stopped calling; True if it did."""
        async with self._lock:
            if not self.state.lease_expired(self.clock.now()):
                return False
            cid = self.state.checkpoint_id
            log.warning(
                "%s/%s: lease of checkpoint %s expired; resuming", self.kind, self.instance, cid
            )
            if self.state.phase is Phase.RESTORED:
                # Nobody will retry or resume this restore: stop an install
                # still running and free what no restore call answered for,
                # before admission reopens.
                await self._restores.abandon()
            await self._apply(self.state.fire(Event.LEASE_EXPIRED))
            self._background.release()  # resumed by itself: the held write goes on
            if self.observer is not None:
                self.observer.lease_expired()
            return True

    def start(self) -> None:
        """Start the lease watcher on the running loop (idempotent)."""
        self._lease.start()

    async def aclose(self) -> None:
        await self._lease.stop()
        await self._restores.aclose()
        await self._background.aclose()
        for write in list(self._writes.values()):
            await write.close()
        self._writes.clear()
