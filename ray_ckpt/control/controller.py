"""The participant controller: one per Gym server, transport-agnostic.

It owns the pure phase machine (`ray_ckpt.control.phase_machine`), the retire marks, the
lease watcher, the readiness wait and the deadline-bounded storage calls, and
carries out what the machine decides on the participant hooks.  The HTTP
routes and the Ray actor methods both call `handle()`, so every transport
drives the same code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from ray_ckpt.clock import SYSTEM_CLOCK, Clock
from ray_ckpt.control.phase_machine import ControlState, Effect, Event, Phase, Transition
from ray_ckpt.control.protocol import Participant
from ray_ckpt.control.retire_marks import RetiredAttempts
from ray_ckpt.control.wire import (
    MAX_REPORTED_BLOCKERS,
    CheckpointRequest,
    CommitRequest,
    ForgetRequest,
    RestoreRequest,
    RetireRequest,
    decode_request,
    to_builtins,
)
from ray_ckpt.errors import (
    CheckpointConflict,
    CheckpointError,
    DeadlineExceeded,
    InvalidCheckpointState,
    InvalidPhase,
    RestartInScope,
)
from ray_ckpt.identity import EpisodeId
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage.record import Record, check_json
from ray_ckpt.storage.seam import FileRecordStore, RecordStore, StopHandle

log = logging.getLogger(__name__)
T = TypeVar("T")

# The readiness wait re-checks at least this often even without a notify.
_READY_POLL_S = 1.0


@dataclass
class _Write:
    """One checkpoint's export, made once; a retried commit awaits the same write."""

    checkpoint_dir: str
    scope: tuple[EpisodeId, ...] | None
    records: list[Record]
    stop: StopHandle
    task: asyncio.Task[Any] | None = None


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
        self.store: RecordStore = store or FileRecordStore()
        self.state = ControlState()
        self.retired = RetiredAttempts()
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._writes: dict[str, _Write] = {}
        self._retiring = 0
        self._restored_once = False
        self._install: asyncio.Future[list[EpisodeId]] | None = None
        self._watcher: asyncio.Task[None] | None = None
        participant.bind(self.notify)

    # --- plumbing ----------------------------------------------------------
    def notify(self) -> None:
        """Participants call this whenever readiness may have changed."""
        self._changed.set()

    async def _within(self, req: CheckpointRequest, what: str, aw: Awaitable[T]) -> T:
        """Run `aw` inside the request's remaining time, or `deadline_exceeded`."""
        remaining = req.remaining(self.clock.now())
        try:
            async with asyncio.timeout(remaining):
                return await aw
        except TimeoutError:
            raise DeadlineExceeded(f"{what} of {req.checkpoint_id} missed its deadline") from None

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
                    # Waits only for a publication already under way.
                    await asyncio.to_thread(write.stop.stop)
        self.notify()

    async def handle(self, op: str, body: bytes | dict[str, Any]) -> dict[str, Any]:
        """Decode, dispatch and answer one control call (any transport)."""
        if op == "status":
            return self.status()
        req = decode_request(op, body)
        handler = getattr(self, op)
        reply: dict[str, Any] = await handler(req)
        return reply

    # --- status ------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "instance": self.instance,
            "phase": self.state.phase.value,
            "checkpoint_id": self.state.checkpoint_id,
            "lease_expires_at": self.state.lease_expires_at,
            "retired_rollouts": len(self.retired),
            "retiring": self._retiring,
            "live_executions": self.participant.live_executions(),
            "report": to_builtins(self.participant.report(MAX_REPORTED_BLOCKERS)),
        }

    # --- prepare -----------------------------------------------------------
    async def prepare(self, req: CheckpointRequest) -> dict[str, Any]:
        cid = req.checkpoint_id
        async with self._lock:
            cached = self.state.admit("prepare", cid)
            if cached is not None:
                return dict(cached)
            req.remaining(self.clock.now())
            if self.state.phase is Phase.IDLE:
                transition = self.state.fire(Event.PREPARE, cid)
                try:
                    await self._apply(transition)
                except BaseException:
                    await self._apply(self.state.fire(Event.CLOSE_FAILED))
                    raise
            self._renew(req)
        # Wait outside the lock so a resume can interrupt this prepare.
        await self._wait_ready(req)
        async with self._lock:
            report = to_builtins(self.participant.report(MAX_REPORTED_BLOCKERS))
            if self.state.checkpoint_id != cid:
                return {"phase": self.state.phase.value, "report": report}
            if self.state.phase is Phase.PREPARING and self.participant.ready():
                self.state.fire(Event.READY)
                report = to_builtins(self.participant.report(MAX_REPORTED_BLOCKERS))
                reply = {"phase": Phase.PREPARED.value, "report": report}
                self.state.cache("prepare", cid, reply)
                return reply
            return {"phase": self.state.phase.value, "report": report}

    async def _wait_ready(self, req: CheckpointRequest) -> None:
        cid = req.checkpoint_id
        while True:
            self._changed.clear()
            if self.state.checkpoint_id != cid or self.participant.ready():
                return
            left = req.deadline_ts - self.clock.now()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, _READY_POLL_S)):
                    await self._changed.wait()

    # --- renew ---------------------------------------------------------------
    async def renew(self, req: CheckpointRequest) -> dict[str, Any]:
        async with self._lock:
            self.state.admit("renew", req.checkpoint_id)
            req.remaining(self.clock.now())
            self._renew(req)
            return {"lease_expires_at": self.state.lease_expires_at}

    # --- commit --------------------------------------------------------------
    async def commit(self, req: CommitRequest) -> dict[str, Any]:
        cid = req.checkpoint_id
        scope = tuple(req.episode_ids) if req.episode_ids is not None else None
        async with self._lock:
            write = self._writes.get(cid)
            if write is not None and (write.checkpoint_dir, write.scope) != (
                req.checkpoint_dir,
                scope,
            ):
                raise CheckpointConflict(
                    f"commit of {cid} already runs with another directory or scope"
                )
            cached = self.state.admit("commit", cid)
            if cached is not None:
                return dict(cached)
            self._renew(req)
            if write is None:
                if not self.participant.ready():
                    raise InvalidPhase(f"{self.kind}/{self.instance} is no longer ready")
                write = await self._export(req, scope)
            failed = (
                write.task is not None
                and write.task.done()
                and (write.task.cancelled() or write.task.exception() is not None)
            )
            if write.task is None or failed:
                # First try, or a retry after the store failed: store the same records again.
                write.task = asyncio.ensure_future(
                    asyncio.to_thread(
                        self.store.write,
                        req.checkpoint_dir,
                        kind=self.kind,
                        instance=self.instance,
                        checkpoint_id=cid,
                        records=write.records,
                        stop=write.stop,
                    )
                )
            task = write.task
        # The write is shielded: a missed deadline fails this call, not the write.
        manifest = await self._within(req, "commit write", asyncio.shield(task))
        async with self._lock:
            if self.state.checkpoint_id != cid or self.state.phase is not Phase.PREPARED:
                cached = self.state.results.get((cid, "commit"))
                if cached is not None:
                    return dict(cached)
                raise InvalidCheckpointState(f"commit of {cid} was stopped by a resume")
            self.state.fire(Event.COMMIT)
            if scope is not None:
                await self._within(req, "release unscoped", self.participant.delete_restored(scope))
            if req.stop:
                await self._park_exported(write.records)
            reply = {
                "phase": Phase.COMMITTED.value,
                "manifest": to_builtins(manifest),
                "episode_ids": sorted(r.key for r in write.records),
            }
            self.state.cache("commit", cid, reply)
            return reply

    async def _park_exported(self, records: list[Record]) -> None:
        """The controller stops instead of resuming: once the write is durable,
        free external compute the exported episodes hold (best effort: a
        failure only costs resources, never the checkpoint)."""
        park = getattr(self.participant, "park_exported", None)
        if park is None:
            return
        try:
            await park(records)
        except Exception:
            log.warning("%s/%s: park_exported failed", self.kind, self.instance, exc_info=True)

    async def _export(self, req: CommitRequest, scope: tuple[EpisodeId, ...] | None) -> _Write:
        if scope is not None:
            restarts = set(self.participant.report(MAX_REPORTED_BLOCKERS).restarts)
            named = sorted(e.capture_key for e in scope if e.capture_key in restarts)
            if named:
                raise RestartInScope(f"commit scope names restart-only episodes {named}")
        records = await self._within(req, "export", self.participant.export(scope))
        if scope is not None:
            wanted = {e.capture_key for e in scope}
            records = [r for r in records if r.key in wanted]
        for record in records:
            check_json(record.state, episode=record.key)
        write = _Write(req.checkpoint_dir, scope, records, self.store.new_stop())
        self._writes[req.checkpoint_id] = write
        return write

    # --- restore -------------------------------------------------------------
    async def restore(self, req: RestoreRequest) -> dict[str, Any]:
        cid = req.checkpoint_id
        async with self._lock:
            cached = self.state.admit("restore", cid)
            if cached is not None:
                return dict(cached)
            if self._restored_once or not self.participant.fresh():
                raise InvalidPhase(
                    f"{self.kind}/{self.instance}: restore needs a fresh process that has "
                    "served nothing and restored nothing"
                )
            wanted = {e.capture_key for e in req.episode_ids}
            manifest, records = await self._within(
                req,
                "restore read",
                asyncio.to_thread(
                    self.store.read,
                    req.checkpoint_dir,
                    kind=self.kind,
                    instance=self.instance,
                    select=wanted.__contains__,
                ),
            )
            await self._apply(self.state.fire(Event.RESTORE, cid))
            # Shielded: an install that outlives the deadline keeps running (the
            # call fails); retire and resume wait for it, so admission never
            # reopens on half-installed state and a cleanup retire frees it all.
            install = asyncio.ensure_future(self.participant.install(records))
            self._install = install
            try:
                installed = await self._within(req, "install", asyncio.shield(install))
            except DeadlineExceeded:
                self._restored_once = True
                raise
            except BaseException:
                # Nothing was installed (install is all or nothing): reopen.
                await self._apply(self.state.fire(Event.RESTORE_FAILED))
                raise
            self._restored_once = True
            self._renew(req)
            reply = {
                "phase": Phase.RESTORED.value,
                "source_checkpoint_id": getattr(manifest, "checkpoint_id", None),
                "restored": sorted(e.capture_key for e in installed),
            }
            self.state.cache("restore", cid, reply)
            return reply

    async def _installed(self) -> None:
        """Wait for an install that outlived its restore call (its outcome is moot)."""
        if self._install is not None and not self._install.done():
            await asyncio.wait([self._install])

    # --- resume --------------------------------------------------------------
    async def resume(self, req: CheckpointRequest) -> dict[str, Any]:
        cid = req.checkpoint_id
        async with self._lock:
            if self.state.is_resumed(cid):
                return {"phase": self.state.phase.value, "idempotent": True}
            active = self.state.checkpoint_id
            if active is not None and active != cid:
                raise CheckpointConflict(f"checkpoint {active} is open; resume of {cid} refused")
            if active is None:
                # The prepare never reached us: record the ID so it is refused if it does.
                self.state.remember_resumed(cid)
                return {"phase": self.state.phase.value, "idempotent": False}
            await self._installed()
            await self._apply(self.state.fire(Event.RESUME))
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
            self._retiring += len(req.episode_ids)
        try:
            await self._within(req, "install wait", self._installed())
            keys = await self._within(req, "retire", self.participant.retire(req.episode_ids))
        finally:
            self._retiring -= len(req.episode_ids)
            self.notify()
        return {"retired": sorted(keys)}

    async def forget(self, req: ForgetRequest) -> dict[str, Any]:
        async with self._lock:
            self.state.admit("forget", req.checkpoint_id)
            return {"forgotten": self.retired.forget(req.rollout_ids)}

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
            await self._apply(self.state.fire(Event.LEASE_EXPIRED))
            return True

    async def _watch_lease(self) -> None:
        while True:
            expires = self.state.lease_expires_at
            wait = 0.5 if expires is None else min(max(expires - self.clock.now(), 0.01), 0.5)
            await asyncio.sleep(wait)
            try:
                await self.check_lease()
            except CheckpointError:
                log.exception("lease check failed")

    def start(self) -> None:
        """Start the lease watcher on the running loop (idempotent)."""
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch_lease())

    async def aclose(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        for write in list(self._writes.values()):
            await asyncio.to_thread(write.stop.stop)
            if write.task is not None:
                with contextlib.suppress(BaseException):
                    await write.task
        self._writes.clear()
