"""The participant engine: one per Gym server, transport-agnostic.

`ParticipantEngine` owns the pure phase machine
(`ray_ckpt.control.phase_machine`), the retire marks, the lock and the
registry of commit writes, and carries out what the machine decides on the
participant hooks.  The HTTP routes and the Ray actor methods both call
`handle()`, so every transport drives the same code.

Every operation's order of steps reads in this class: admission of the
call, phase transitions, the work started and awaited, replies cached for
retries.  Commit's and restore's work outlives the call: both start it once
under the lock, shield it, and await it within the call's deadline, so a
missed deadline or a cancelled call fails the call, not the work, and a
retry with the same checkpoint ID awaits (or, after a failure, restarts)
that same work; the reply is cached only once all of it, release steps
included, is done.

The work of the steps lives in helpers given only what they use: `commit`
(the write-once export and its store write), `background` (an asynchronous
commit's write, after the resume), `restore` (the once-per-process read and
install), `timing` (the call deadline, the readiness wait, the lease
watcher) and `receipt_ops` (the held results behind `ack` and `collect`).
The engine hands them its `store` and `clock` at each call, not once,
so replacing either (a test swaps `store`) reaches them too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections import Counter
from typing import Any

from ray_ckpt.clock import SYSTEM_CLOCK, Clock
from ray_ckpt.control import receipt_ops
from ray_ckpt.control.background import BackgroundWrites, Pending
from ray_ckpt.control.commit import Commits, CommitScope, Write, commit_reply, exported_keys
from ray_ckpt.control.observer import ControlObserver
from ray_ckpt.control.phase_machine import ControlState, Effect, Event, Phase, Transition
from ray_ckpt.control.protocol import Participant
from ray_ckpt.control.restore import Restores, restore_reply
from ray_ckpt.control.timing import LeaseWatcher, ReadinessWait, within
from ray_ckpt.control.wire import (
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
    to_builtins,
)
from ray_ckpt.errors import (
    CheckpointConflict,
    CheckpointError,
    InvalidCheckpointState,
    InvalidRequest,
    Reason,
    ReceiptsOff,
    StaleCoordinator,
)
from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import MAX_REPORTED_BLOCKERS
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.steps.retire_marks import RetiredAttempts
from ray_ckpt.storage.seam import FileRecordStore, RecordStore

log = logging.getLogger(__name__)

# The refusals that fence someone off (a superseded coordinator, a resumed
# checkpoint's late call), counted by code in `status()["fenced"]`.
FENCING_REASONS = frozenset({Reason.STALE_COORDINATOR, Reason.STALE_CHECKPOINT})


class ParticipantEngine:
    """One Gym server's control plane: every control call and the lease lapse.

    Every state-changing call is idempotent under its checkpoint ID (a retry
    answers the cached reply, or finishes the work the first call started).
    `store`, `clock` and `settings` are read at each use, so a host or a test
    may replace them; the participant is bound once (it is handed `notify`),
    and the helpers hold it from here.
    """

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
        self._ready = ReadinessWait()
        # The commit writes under way, by checkpoint ID; a resume or lease expiry stops them.
        self._writes: dict[str, Write] = {}
        self._commits = Commits(participant, instance=instance)
        self._restores = Restores(participant, instance=instance, fence=self.retired.fence)
        # The attempts named by the retires in flight (with repeats), for a
        # participant without a `retiring()` hook.
        self._retiring: Counter[EpisodeId] = Counter()
        self._lease = LeaseWatcher(self.check_lease, self._lease_left)
        # The asynchronous commit's write, running past its checkpoint's resume.
        self._background = BackgroundWrites()
        # Told of every call and lease expiry (the host's metrics); none off Ray.
        self.observer: ControlObserver | None = None
        # Which process answers: a server whose port several processes share,
        # each with a engine of its own, shows several (refused at
        # discovery, `ray_ckpt.workers.detect`).
        self.process_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # The newest coordinator epoch a control call carried (None: none
        # yet).  In memory only: a relaunched process starts without one and
        # takes the first epoch it is sent; the coordinator's check of its
        # epoch before publishing keeps a stale one from completing anything.
        self.coordinator_epoch: int | None = None
        # Control calls refused as fenced, by code (`FENCING_REASONS`).
        self.fenced: Counter[str] = Counter()
        # The epoch of the call that opened the checkpoint or restore open now
        # (None: opened by a call without one); a newer coordinator's call
        # ends it (`_supersede`).
        self._opened_by: int | None = None
        participant.bind(self.notify)

    # --- plumbing ----------------------------------------------------------
    def notify(self) -> None:
        """Participants call this whenever readiness may have changed."""
        self._ready.notify()

    def _renew(self, req: CheckpointRequest) -> None:
        self.state.renew(req.deadline_ts, self.settings.lease_grace_seconds)

    def _lease_left(self) -> float | None:
        """Seconds until the lease expires (None: no lease), for the watcher."""
        expires = self.state.lease_expires_at
        return None if expires is None else expires - self.clock.now()

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
        try:
            if op in RECEIPT_OPERATIONS:
                # Receipts carry no checkpoint and no epoch: never fenced.
                req: CheckpointRequest | AckRequest | CollectRequest = decode_receipt_request(
                    op, body
                )
            else:
                req = decode_request(op, body)
                if self.admit_epoch(op, req.coordinator_epoch):
                    await self._supersede(req.checkpoint_id)
            handler = getattr(self, op)
            reply: dict[str, Any] = await handler(req)
            return reply
        except CheckpointError as exc:
            if exc.reason in FENCING_REASONS:
                self.fenced[exc.code] += 1
            raise

    def admit_epoch(self, op: str, epoch: int | None) -> bool:
        """The epoch rule: a call carrying an epoch older than the newest one
        seen is refused (`StaleCoordinator`), before anything else is looked
        at; an equal or newer one is admitted and becomes the newest; a call
        without one (NeMo Gym's controller) is admitted as before.

        Checked and raised without an await in between, so no call of an
        older coordinator starts once a newer one's call has arrived (one
        already running finishes, as any call the lock orders before).
        True when `epoch` is newer than every one seen before."""
        if epoch is None:
            return False
        seen = self.coordinator_epoch
        if seen is not None and epoch < seen:
            raise StaleCoordinator(
                f"{self.kind}/{self.instance}: {op} from coordinator epoch {epoch} refused: "
                f"epoch {seen} has taken over"
            )
        self.coordinator_epoch = epoch
        return seen is None or epoch > seen

    async def _supersede(self, checkpoint_id: str) -> None:
        """A newer coordinator's first call: a checkpoint or restore an older
        one opened here (and not this call's) is ended now, as its lease
        lapsing would end it.  Its coordinator can neither finish nor resume
        it any more (every call of its is refused), so waiting for the lease
        would only keep admission closed and the newer coordinator's own
        prepare refused (`checkpoint_conflict`) that long.  A checkpoint the
        newer coordinator knows of (its recovery's resume names it) is ended
        by that resume instead.  An asynchronous commit captured for it is
        discarded: it can never be published."""
        async with self._lock:
            cid = self.state.checkpoint_id
            opened_by = self._opened_by
            newest = self.coordinator_epoch
            if cid is None or cid == checkpoint_id or opened_by is None or newest is None:
                return
            if opened_by >= newest:
                return
            log.warning(
                "%s/%s: checkpoint %s of coordinator epoch %d ended: epoch %d has taken over",
                self.kind,
                self.instance,
                cid,
                opened_by,
                newest,
            )
            await self._end_open()
            await self._background.discard(cid)

    async def _end_open(self) -> None:
        """End the open checkpoint or restore as a lapsed lease does (lock held)."""
        if self.state.phase is Phase.RESTORED:
            # Nobody will retry or resume this restore: stop an install
            # still running and free what no restore call answered for,
            # before admission reopens.
            await self._restores.abandon()
        await self._apply(self.state.fire(Event.LEASE_EXPIRED))

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
            # Optional hooks: which episodes are in flight (capped), and an
            # export that needs a named scope (the CLI asks before pausing).
            "live_keys": _live_keys(self.participant),
            "needs_scope": bool(getattr(self.participant, "needs_scope", False)),
            # What a restore needs (`control.restore`): the coordinator checks
            # it before changing anything anywhere.
            "fresh": self.participant.fresh() and not self._restores.restored_once,
            "writes_in_flight": self.writes_in_flight,
            "background_write": self._background.status(),
            **receipt_ops.status_fields(receipt_ops.holder(self.participant)),
            "report": report_reply(self.participant.report(MAX_REPORTED_BLOCKERS)),
            "process": self.process_id,
            # The newest coordinator epoch seen (its presence tells a
            # coordinator that this participant takes epochs) and the calls
            # refused as fenced, by code.
            "coordinator_epoch": self.coordinator_epoch,
            "fenced": dict(self.fenced),
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
                self._opened_by = req.coordinator_epoch
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
        await self._ready.wait(
            lambda: self.state.checkpoint_id != cid or self.participant.ready(),
            req.deadline_ts,
            self.clock,
        )
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

    # --- commit ----------------------------------------------------------------
    async def commit(self, req: CommitRequest) -> dict[str, Any]:
        cid = req.checkpoint_id
        scope = tuple(req.episode_ids) if req.episode_ids is not None else None
        if self._background.knows(cid):
            # The commit of an asynchronous checkpoint, re-sent: wait for its write
            # (never stopping it), whether this participant has resumed since or not.
            # Only the same commit: one naming another directory or scope is
            # refused, as the synchronous path refuses it (`Write.check_same`).
            self._background.check_same(req, scope)
            return await self._background.outcome(cid, req.remaining(self.clock.now()))
        if req.durability == "async":
            return await self._commit_async(req, scope)
        async with self._lock:
            write = self._writes.get(cid)
            if write is not None:
                write.check_same(req, scope)
            # Durable but not answered: a release step failed; a retry finishes it.
            releasing = write is not None and write.manifest is not None
            cached = self.state.admit("commit", cid, unfinished=releasing)
            if cached is not None:
                return dict(cached)
            # Refusals first (a passed deadline, an export the participant
            # refuses: no scope where it needs one, a restart-only episode in
            # it): a refused commit changes nothing, the lease included.
            req.remaining(self.clock.now())
            if write is None:
                write = await self._commits.export(req, scope, self.store, self.clock)
                self._writes[cid] = write
            # Accepted: the lease now covers this call's deadline.
            self._renew(req)
            if releasing:
                return await self._finish_commit(req, scope, write)
            # First try, or a retry after the store failed: store the same records again.
            task = self._commits.start(write, req, self.store, self.clock)
        # The write is shielded: a missed deadline fails this call, not the write.
        manifest = await within(self.clock, req, "commit write", asyncio.shield(task))
        async with self._lock:
            if self.state.checkpoint_id != cid or self._writes.get(cid) is not write:
                cached = self.state.results.get((cid, "commit"))
                if cached is not None:
                    return dict(cached)
                raise InvalidCheckpointState(f"commit of {cid} was stopped by a resume")
            if self.state.phase is Phase.PREPARED:
                self.state.fire(Event.COMMIT)
                write.manifest = manifest
            cached = self.state.results.get((cid, "commit"))
            if cached is not None:
                # A concurrent retry of this commit finished it first.
                return dict(cached)
            return await self._finish_commit(req, scope, write)

    async def _finish_commit(
        self, req: CommitRequest, scope: CommitScope, write: Write
    ) -> dict[str, Any]:
        """Once the write is durable, the release steps, then the reply, cached
        only once all of it is done: drop the restored state the scope left
        out, and park the exported episodes if the engine stops.

        A step that misses the deadline (or whose call is cancelled) raises
        and is run again by a retry of the same commit; a step done is not
        repeated (`write.released`, `write.parked`).
        """
        started = self.clock.now()
        if scope is not None and not write.released:
            await within(
                self.clock, req, "release unscoped", self.participant.delete_restored(scope)
            )
        write.released = True
        if req.stop and not write.parked:
            await self._commits.park_exported(req, write.records, self.clock)
        write.parked = True
        write.spans.append(("release", started, self.clock.now()))
        reply = commit_reply(write)
        self.state.cache("commit", req.checkpoint_id, reply)
        return reply

    async def _commit_async(self, req: CommitRequest, scope: CommitScope) -> dict[str, Any]:
        """Capture, answer `pending`, and leave the write to `_background`."""
        cid = req.checkpoint_id
        if req.stop:
            raise InvalidRequest(
                "stop needs durability sync: a participant that stops frees its state once "
                "it is durable, and an asynchronous commit answers before that"
            )
        async with self._lock:
            cached = self.state.admit("commit", cid)
            if cached is not None:
                return dict(cached)
            req.remaining(self.clock.now())
            busy = self._background.busy()
            if busy is not None:  # the prepare waited for it; a commit without one did not
                raise CheckpointConflict(f"the write of {busy} still runs; prepare waits for it")
            write = await self._commits.export(req, scope, self.store, self.clock, capture=True)
            # Accepted only once captured: every refusal above changes nothing,
            # the lease included.
            self._renew(req)
            if scope is not None:
                # The capture holds its own copy: freeing restored state the
                # scope leaves out cannot change what is written.
                await within(
                    self.clock, req, "release unscoped", self.participant.delete_restored(scope)
                )
            write.released = write.parked = True
            # `captured_bytes` is unknown yet, so null, never 0: the copy is
            # measured by the write as it reads it, after the resume
            # (`capture.Audited`); `status` and the final reply give the figure.
            reply = {
                "phase": Phase.COMMITTED.value,
                "pending": True,
                "captured_bytes": write.captured_bytes,
                **exported_keys(write.records),
                "spans": write.span_dicts(),
            }
            # Started at the resume (`BackgroundWrites.release`), with the store
            # and clock in place then.
            self._background.adopt(
                Pending(
                    cid, write, lambda: self._commits.start(write, req, self.store, self.clock)
                ),
                reply,
            )
            self.state.fire(Event.COMMIT)
            self.state.cache("commit", cid, reply)
            return dict(reply)

    # --- restore --------------------------------------------------------------
    async def restore(self, req: RestoreRequest) -> dict[str, Any]:
        cid = req.checkpoint_id
        async with self._lock:
            install = self._restores.pending(cid)
            cached = self.state.admit("restore", cid, unfinished=install is not None)
            if cached is not None:
                return dict(cached)
            if install is not None:
                install.check_same(req)
            else:
                manifest, records = await self._restores.read(req, self.store, self.clock)
                await self._apply(self.state.fire(Event.RESTORE, cid))
                self._opened_by = req.coordinator_epoch
                install = self._restores.begin(req, manifest, records)
            # The lease runs from the restore's start: if the install outlives
            # this call and the coordinator goes away, the lease still resumes.
            self._renew(req)
            try:
                # Shielded: a missed deadline or a cancelled call (ray.cancel
                # of the coordinator's fan-out) ends this call, not the
                # install; the phase stays restored with admission closed
                # until the install ends and a retry, resume or lapse decides.
                installed = await within(self.clock, req, "install", asyncio.shield(install.task))
            except BaseException:
                if not install.failed():
                    raise
                # The install itself raised: free what it left, reopen, and
                # answer with a typed error (the ID is not consumed).
                error = self._restores.failure(install)
                cause = None if install.task.cancelled() else install.task.exception()
                await self._restores.settle()
                await self._apply(self.state.fire(Event.RESTORE_FAILED))
                raise error from cause
            install.answered = True
            reply = restore_reply(install.manifest, installed)
            self.state.cache("restore", cid, reply)
            return reply

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
        held = receipt_ops.holder(self.participant)
        if held is None:
            raise ReceiptsOff(
                f"{self.kind}/{self.instance} holds no results: completion receipts are off here"
            )
        if req.check:
            known, unknown = await held.known(req.receipts)
            return {"known": to_builtins(known), "unknown": to_builtins(unknown)}
        now, before = await held.ack(req.receipts)
        if now:
            self.notify()  # a prepare waiting below the bound may be ready now
        return {
            "acknowledged": to_builtins(now),
            "already": to_builtins(before),
            **receipt_ops.status_fields(held),
        }

    async def collect(self, _req: CollectRequest) -> dict[str, Any]:
        held = receipt_ops.holder(self.participant)
        results = await held.collect() if held is not None else []
        return {"results": results, **receipt_ops.status_fields(held)}

    # --- lease ---------------------------------------------------------------
    async def check_lease(self) -> bool:
        """Resume by itself if the engine stopped calling; True if it did."""
        async with self._lock:
            if not self.state.lease_expired(self.clock.now()):
                return False
            cid = self.state.checkpoint_id
            log.warning(
                "%s/%s: lease of checkpoint %s expired; resuming", self.kind, self.instance, cid
            )
            await self._end_open()
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


def _live_keys(participant: Any) -> list[str] | None:
    """The capture keys a participant's `live_keys` hook names, sorted and
    capped as blockers are (None: a participant without the hook)."""
    hook = getattr(participant, "live_keys", None)
    if hook is None:
        return None
    return sorted(str(k) for k in hook())[:MAX_REPORTED_BLOCKERS]
