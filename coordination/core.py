"""`CoordinatorCore`: every coordinated operation, without Ray.

The `Coordinator` actor wraps one of these and adds only Ray concerns
(discovery by name, recovery when Ray restarts it), so this logic is
unit-tested deterministically with fake hosts.  One operation runs at a time;
`renew` and `status` may run beside any of them.

Here: the public operations (each taking the lock), checkpoint, retire/forget
in order, status and recover.  The phases themselves are `PhaseDriver`'s
(`coordination.phase_driver`); restore and its undo are in
`coordination.restore`, the status rows in `coordination.status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any

from coordination.async_commit import PendingWrites, confirm_durable
from coordination.calls import coordination_failed, episode_body, new_id
from coordination.fanout import failure
from coordination.hosts import Host
from coordination.manifests import ManifestReader, read_listed, read_listed_or_participants
from coordination.membership import checked, discover_candidates
from coordination.metrics import CoordinatorMetrics
from coordination.order import Member, forget_groups, retire_groups
from coordination.phase_driver import PhaseDriver
from coordination.replies import string_list
from coordination.restore import fail_if_state_lost, restore, undo_restore
from coordination.results import (
    CheckpointResult,
    CommitResult,
    CoordinatorStatus,
    DurableResult,
    ForgetResult,
    LastCheckpoint,
    PrepareResult,
    RestoreResult,
    ResumeResult,
    RetireResult,
)
from coordination.roots import (
    precreate_participant_dirs,
    ready_for_checkpoint,
    write_latest_quietly,
)
from coordination.status import participant_rows
from ray_ckpt import tracing
from ray_ckpt.errors import CheckpointError, DeadlineExceeded, InvalidPhase, InvalidRequest
from ray_ckpt.identity import EpisodeId

log = logging.getLogger(__name__)

# The episodes a checkpoint without a scope continues (the assembler's in flight).
# Directories remembered as possibly still written into by a failed checkpoint.
KEPT_LATE = 64
ScopeSource = Callable[[], Awaitable[Sequence[EpisodeId]]]


class CoordinatorCore(PhaseDriver):
    def __init__(
        self,
        *,
        manifest_reader: ManifestReader = read_listed,
        unlisted_reader: ManifestReader = read_listed_or_participants,
        metrics: CoordinatorMetrics | None = None,
        **kwargs: Any,
    ) -> None:
        # After the Gym manifest, the parent's LATEST names the checkpoint.
        kwargs.setdefault("latest_writer", write_latest_quietly)
        # Before the pause: no checkpoint over a complete one, no aborted leftovers.
        kwargs.setdefault("directory_guard", ready_for_checkpoint)
        super().__init__(**kwargs)
        self.manifest_reader = manifest_reader
        # Only when a restore asks for it (`allow_without_gym_manifest`).
        self.unlisted_reader = unlisted_reader
        # Off Ray a null sink; the actor passes Ray's (`coordination.metrics`).
        self.metrics = metrics or CoordinatorMetrics()
        self.last_checkpoint: LastCheckpoint | None = None
        # Asynchronous checkpoints resumed and not yet published.
        self.pending = PendingWrites()
        # Directories a checkpoint failed in after its commit was sent: a
        # participant may still write there (a captured write the abort's
        # resume released, a write whose reply was lost), until its next
        # prepare, which waits for that write.  A retry there clears them
        # again after its prepare (`_clear_late_writes`).
        self._late_writes: OrderedDict[str, None] = OrderedDict()

    # --- checkpoint ------------------------------------------------------------
    async def prepare(self, deadline_s: float | None = None) -> PrepareResult:
        """Open a checkpoint: pause controllers, prepare group by group.

        An asynchronous checkpoint still publishing is waited for first, as
        by `checkpoint`: a checkpoint opened after it never becomes `latest`
        before it (the split commit's `LATEST` would be overwritten by it)."""
        async with self.lock:
            await self.pending.settle()
            return await self._prepare(deadline_s)

    async def commit(
        self,
        checkpoint_dir: str,
        scope: Sequence[EpisodeId] | None = None,
        *,
        stop: bool = False,
        strict: bool = False,
        deadline_s: float | None = None,
        scope_source: ScopeSource | None = None,
    ) -> CommitResult:
        """Commit the open checkpoint everywhere, then write the Gym manifest.

        `strict`: refuse (`RestartInScope`, checkpoint aborted, no Gym
        manifest) if an episode of the scope has no state at any participant;
        not with `stop` (that frees the exported episodes' resources first).
        `scope_source`: asked for the scope when none is given."""
        async with self.lock:
            await self.pending.settle()  # none may still write into `checkpoint_dir`
            entry = self.open
            if entry is not None and entry.op == "checkpoint" and entry.phase == "prepared":
                # Refused (the checkpoint stays prepared: commit elsewhere or
                # resume) before any participant writes into a complete one.
                await self._guard_directory(checkpoint_dir)
            if scope is None and scope_source is not None and self.open is not None:
                scope = await self._asked_scope(self.open.checkpoint_id, scope_source)
            with self._writing_into(checkpoint_dir):
                return await self._commit(
                    checkpoint_dir, scope, stop=stop, strict=strict, deadline_s=deadline_s
                )

    async def _guard_directory(self, checkpoint_dir: str) -> None:
        if self.directory_guard is not None:
            await asyncio.to_thread(self.directory_guard, checkpoint_dir)

    @contextlib.contextmanager
    def _writing_into(self, checkpoint_dir: str) -> Iterator[None]:
        """Around a commit: remember `checkpoint_dir` if it fails (participants
        may write there after), forget it once a commit there succeeded."""
        try:
            yield
        except BaseException:
            self._late_writes_in(checkpoint_dir)
            raise
        self._late_writes.pop(checkpoint_dir, None)

    def _late_writes_in(self, checkpoint_dir: str) -> None:
        self._late_writes[checkpoint_dir] = None
        self._late_writes.move_to_end(checkpoint_dir)
        while len(self._late_writes) > KEPT_LATE:
            self._late_writes.popitem(last=False)

    async def _clear_late_writes(self, cid: str, checkpoint_dir: str) -> None:
        """After the prepare of a retry into a directory a failed checkpoint
        wrote into: every participant's earlier write has ended (its prepare
        waited for it), so what landed since the check before the prepare is
        cleared too.  Aborts the open checkpoint if that fails."""
        if checkpoint_dir in self._late_writes:
            async with self._aborting(cid):
                await self._guard_directory(checkpoint_dir)

    def _fit(self, asked: float | None, default: float, publish_by: float) -> float:
        """A phase deadline cut to what is left before `publish_by`."""
        left = publish_by - self.clock.now()
        if left <= 0:
            raise DeadlineExceeded("the checkpoint's overall deadline passed before it began")
        return min(default if asked is None else asked, left)

    async def resume(self, deadline_s: float | None = None) -> ResumeResult:
        """Close (or abort) the open checkpoint; idempotent.  The resume of a
        restore left open fails it whole if a participant lost restored
        state since its install (`fail_if_state_lost`)."""
        async with self.lock:
            entry = self.open
            result = await self._resume(deadline_s)
            if entry is not None and entry.op == "restore":
                episodes = [EpisodeId.from_capture_key(k) for k in entry.episode_ids]
                await fail_if_state_lost(self, entry.checkpoint_id, episodes, result.failures)
            return result

    async def renew(self) -> dict[str, float | None]:
        return await self.renewer.renew()

    async def checkpoint(
        self,
        checkpoint_dir: str,
        scope: Sequence[EpisodeId] | None = None,
        *,
        resume: bool = True,
        stop: bool = False,
        strict: bool = False,
        prepare_s: float | None = None,
        commit_s: float | None = None,
        scope_source: ScopeSource | None = None,
        total_s: float | None = None,
        trigger: str = "manual",
        durability: str = "sync",
    ) -> CheckpointResult:
        """prepare → commit → Gym manifest → resume (unless kept open to publish).

        `durability="async"`: prepare → commit (captured) → resume, returned
        `pending`; every write durable and then the Gym manifest follow in the
        background (`durable(checkpoint_id)`, `coordination.async_commit`).

        Without a scope, `scope_source` (the assembler's in-flight episodes)
        is asked after the prepare, while the assembler is paused.
        `total_s`: the whole checkpoint's budget, from the call (waiting for
        the lock included): the phase deadlines are cut to fit it, and a
        checkpoint not ready to publish inside it fails whole (no Gym
        manifest, no `LATEST`).  `trigger` (manual, periodic, signal, drain)
        labels its metrics."""
        if durability not in ("sync", "async"):
            raise InvalidRequest(f"durability must be sync or async, not {durability!r}")
        if durability == "async" and (stop or not resume or total_s is not None):
            raise InvalidRequest(
                "durability async resumes the Gym before the write is durable: "
                "not with stop, resume=False or total_s"
            )
        start = time.monotonic()
        before = self.timeline.newest("checkpoint")
        try:
            with tracing.span("ray_ckpt.checkpoint", {"ray_ckpt.trigger": trigger}):
                result = await self._checkpoint(
                    checkpoint_dir,
                    scope,
                    resume=resume,
                    stop=stop,
                    strict=strict,
                    prepare_s=prepare_s,
                    commit_s=commit_s,
                    scope_source=scope_source,
                    total_s=total_s,
                    durability=durability,
                    trigger=trigger,
                )
        except Exception as exc:
            self.metrics.checkpoint_failed(exc, time.monotonic() - start, trigger)
            failed = self.timeline.newest("checkpoint")
            if failed is not None and failed != before:
                self.timeline.finish(failed, outcome="failed", trigger=trigger)
            raise
        self.metrics.checkpoint_done(result, trigger)
        self.last_checkpoint = LastCheckpoint(
            checkpoint_id=result.checkpoint_id,
            checkpoint_dir=result.checkpoint_dir,
            finished_at=self.clock.now(),
            total_s=result.total_s,
            bytes=result.total_bytes,
            trigger=trigger,
        )
        self.timeline.finish(result.checkpoint_id, outcome="ok", trigger=trigger)
        return result

    async def _checkpoint(
        self,
        checkpoint_dir: str,
        scope: Sequence[EpisodeId] | None,
        *,
        resume: bool,
        stop: bool,
        strict: bool,
        prepare_s: float | None,
        commit_s: float | None,
        scope_source: ScopeSource | None,
        total_s: float | None,
        durability: str = "sync",
        trigger: str = "manual",
    ) -> CheckpointResult:
        publish_by = None
        if total_s is not None:
            if total_s <= 0:
                raise InvalidRequest(f"total_s must be positive, not {total_s!r}")
            publish_by = self.clock.now() + total_s
        async with self.lock:
            # The asynchronous checkpoint before this one publishes first, so
            # `LATEST` never goes back in time (the participants' prepare
            # would wait for its writes anyway).
            await self.pending.settle()
            self.baseline.check(self.hosts, trigger)  # before anyone is paused
            if self.open is None:  # else the prepare refuses, touching nothing
                # After the settle: no asynchronous checkpoint writes there any more.
                await self._guard_directory(checkpoint_dir)
            known = [self.layout[k] for k in sorted(self.hosts) if k in self.layout]
            # The folders are made while the prepare runs (see
            # `precreate_participant_dirs`): the commit, not the prepare,
            # needs them, and their fsyncs then cost the cycle nothing.
            folders = (
                asyncio.ensure_future(
                    asyncio.to_thread(precreate_participant_dirs, checkpoint_dir, known)
                )
                if known
                else None
            )
            start = time.monotonic()
            if publish_by is not None:
                prepare_s = self._fit(prepare_s, self.timeouts.prepare_s, publish_by)
            try:
                prepared = await self._prepare(prepare_s)
            finally:
                if folders is not None:
                    await folders  # never raises: a failure is logged
            await self._clear_late_writes(prepared.checkpoint_id, checkpoint_dir)
            if scope is None and scope_source is not None:
                scope = await self._asked_scope(prepared.checkpoint_id, scope_source)
            with self._writing_into(checkpoint_dir):
                committed = await self._commit(
                    checkpoint_dir,
                    scope,
                    stop=stop,
                    strict=strict,
                    deadline_s=commit_s,
                    publish_by=publish_by,
                    durability=durability,
                    defer_latest=resume,
                )
            if committed.pending:
                self._late_writes_in(checkpoint_dir)  # until it is published
            members = self._hosts(self._members())  # before the resume unfreezes them
            self.baseline.record(self.frozen)
            if not resume:
                resumed = None
            elif committed.pending:
                resumed = await self._resume()
            else:
                # Complete with its Gym manifest: the pointer is written while
                # the Gym resumes (one durable replace off the pause), and both
                # end before the lock is let go, so LATEST never goes back.
                resumed, _ = await asyncio.gather(
                    self._resume(), self._write_latest(checkpoint_dir, committed.checkpoint_id)
                )
            if committed.pending:
                self._confirm_later(
                    prepared.checkpoint_id, checkpoint_dir, scope, members, commit_s, trigger
                )
        timings: dict[str, dict[str, float]] = {}
        for op, table in (("prepare", prepared.timings), ("commit", committed.timings)):
            for key, seconds in table.items():
                timings.setdefault(key, {})[op] = seconds
        return CheckpointResult(
            checkpoint_id=prepared.checkpoint_id,
            checkpoint_dir=checkpoint_dir,
            total_s=time.monotonic() - start,
            prepare_s=prepared.seconds,
            commit_s=committed.seconds,
            manifest_s=committed.manifest_s,
            resume_s=resumed.seconds if resumed is not None else None,
            timings=timings,
            bytes=committed.bytes,
            total_bytes=committed.total_bytes,
            episode_ids=committed.episode_ids,
            restarts=prepared.restarts,
            resume_failures=resumed.failures if resumed is not None else {},
            continued=committed.continued,
            restart=committed.restart,
            durability=durability,
            pending=committed.pending,
        )

    def _confirm_later(
        self,
        cid: str,
        checkpoint_dir: str,
        scope: Sequence[EpisodeId] | None,
        members: list[Host],
        commit_s: float | None,
        trigger: str = "manual",
    ) -> None:
        body = {
            "checkpoint_id": cid,
            "checkpoint_dir": checkpoint_dir,
            "episode_ids": None if scope is None else [episode_body(e) for e in scope],
            "stop": False,
            "durability": "async",
        }
        deadline_s = self.timeouts.commit_s if commit_s is None else commit_s

        async def confirm() -> DurableResult:
            try:
                done = await confirm_durable(self, cid, checkpoint_dir, members, body, deadline_s)
            except Exception as exc:
                self._late_writes_in(checkpoint_dir)  # a write may still be running there
                self.metrics.failed("commit", exc)
                self.timeline.finish(cid, outcome="failed")
                log.warning("asynchronous checkpoint %s not published: %s", cid, exc)
                raise
            self._late_writes.pop(checkpoint_dir, None)
            self.metrics.durable_done(done, trigger)
            log.info(
                "durable %s: %d participants, %d bytes, %.3fs after the resume",
                cid,
                len(done.bytes),
                done.total_bytes,
                done.durable_s,
            )
            return done

        self.pending.add(cid, asyncio.ensure_future(confirm()))

    async def durable(self, cid: str) -> DurableResult:
        """The asynchronous checkpoint `cid` once published; raises its failure."""
        return await self.pending.durable(cid)

    async def aclose(self) -> None:
        await self.pending.aclose()  # unpublished: the directories stay incomplete
        await super().aclose()

    async def _asked_scope(self, cid: str, source: ScopeSource) -> list[EpisodeId]:
        """The scope from `source`; if it fails, the open checkpoint is aborted."""
        try:
            return list(await source())
        except BaseException as exc:
            await self._abort(cid)
            if not isinstance(exc, Exception):
                raise
            err = exc if isinstance(exc, CheckpointError) else CheckpointError(repr(exc)[:500])
            raise coordination_failed("commit", cid, {"assembler": failure(err)}) from None

    # --- restore ---------------------------------------------------------------
    async def restore(
        self,
        checkpoint_dir: str,
        episode_ids: Iterable[EpisodeId],
        *,
        resume: bool = True,
        deadline_s: float | None = None,
        allow_without_gym_manifest: bool = False,
    ) -> RestoreResult:
        """All or nothing: every participant restores, or none keeps what it installed.

        `allow_without_gym_manifest`: a directory without ``gym/_manifest.json``
        (as NeMo Gym's controller writes them) is restored from its participant
        manifests, once each is found, complete, and all are of one checkpoint
        ID; without it such a directory is refused."""
        episodes = list(episode_ids)
        reader = self.unlisted_reader if allow_without_gym_manifest else self.manifest_reader
        start = time.monotonic()
        try:
            with tracing.span("ray_ckpt.restore"):
                async with self.lock:
                    # An asynchronous checkpoint still writing would be
                    # committed by participants being restored.
                    await self.pending.settle()
                    result = await restore(
                        self,
                        reader,
                        checkpoint_dir,
                        episodes,
                        resume=resume,
                        deadline_s=deadline_s,
                    )
                    self.baseline.record(self.hosts)  # the restored Gym is the one to keep
        except Exception as exc:
            self.metrics.restore_failed(exc, time.monotonic() - start)
            raise
        self.metrics.restore_done(result)
        self.timeline.finish(result.checkpoint_id, outcome="ok")
        return result

    # --- retire / forget ---------------------------------------------------------
    def _idle_operation_id(self, op: str) -> str:
        entry = self.open
        if entry is None:
            # Fresh every time: any resumed ID is stale at every participant.
            return new_id(op)
        if entry.op == "restore" and entry.phase == "restored":
            return entry.checkpoint_id  # right after a restore the participants expect its ID
        raise InvalidPhase(
            f"checkpoint {entry.checkpoint_id} is open ({entry.phase}): resume it, then {op}"
        )

    async def _in_retire_order(
        self,
        op: str,
        field: str,
        values: list[dict[str, Any]] | list[str],
        deadline_s: float | None,
    ) -> tuple[str, dict[str, list[str]]]:
        oid = self._idle_operation_id(op)
        deadline_ts = self.clock.now() + (
            self.timeouts.retire_s if deadline_s is None else deadline_s
        )
        body = {"checkpoint_id": oid, "deadline_ts": deadline_ts, field: values}
        reply_field = "retired" if op == "retire" else "forgotten"
        done: dict[str, list[str]] = {}
        groups = forget_groups if op == "forget" else retire_groups
        for group in groups(self._members()):
            out = await self._group(group, op, body, deadline_ts)
            done.update({k: string_list(r.get(reply_field)) for k, r in out.replies.items()})
            if out.errors:
                # Callers before callees: stop here; the call is idempotent, retry it.
                raise coordination_failed(op, oid, {k: failure(e) for k, e in out.errors.items()})
        return oid, done

    async def retire(
        self, episode_ids: Iterable[EpisodeId], *, deadline_s: float | None = None
    ) -> RetireResult:
        episodes = [episode_body(e) for e in episode_ids]
        if not episodes:
            raise InvalidRequest("retire needs at least one episode")
        async with self.lock:
            start = time.monotonic()
            oid, retired = await self._in_retire_order(
                "retire", "episode_ids", episodes, deadline_s
            )
            return RetireResult(operation_id=oid, seconds=time.monotonic() - start, retired=retired)

    async def forget(
        self, rollout_ids: Iterable[str], *, deadline_s: float | None = None
    ) -> ForgetResult:
        rollouts = list(rollout_ids)
        if not rollouts:
            raise InvalidRequest("forget needs at least one rollout id")
        async with self.lock:
            start = time.monotonic()
            oid, gone = await self._in_retire_order("forget", "rollout_ids", rollouts, deadline_s)
            return ForgetResult(operation_id=oid, seconds=time.monotonic() - start, forgotten=gone)

    # --- status / recovery -------------------------------------------------------
    async def status(self) -> CoordinatorStatus:
        rows = await participant_rows(self.hosts.values(), self.timeouts.status_s)
        entry = self.open
        return CoordinatorStatus(
            open_checkpoint=entry.checkpoint_id if entry else None,
            phase=entry.phase if entry else None,
            pause_mode=self.pauses.mode,
            controllers=sorted(self.pauses.targets),
            participants=rows,
            last_checkpoint=self.last_checkpoint,
            now=self.clock.now(),
        )

    async def recover(self) -> str | None:
        """Abort what a previous coordinator left open (from the journal); idempotent."""
        async with self.lock:
            await self.settle_journal()
            entry = self.journal.load()
            if entry is None:
                return None
            # Its members as journalled, those that could be found again (a
            # member not found is covered by its lease).
            self.freeze({k: h for k, h in self.hosts.items() if k in entry.members})
            self.open = entry
            log.warning(
                "recovering %s left %s by a previous coordinator", entry.checkpoint_id, entry.phase
            )
            if entry.op == "restore" and entry.phase == "restoring":
                episodes = [EpisodeId.from_capture_key(k) for k in entry.episode_ids]
                await undo_restore(self, entry.checkpoint_id, episodes, self.clock.now())
            else:
                await self.resume_everyone(entry.checkpoint_id)
            return entry.checkpoint_id

    # --- checked membership ------------------------------------------------------
    async def register_checked(self, host: Host) -> Host | None:
        """Register `host` once its status confirms its kind (`KindMismatch`
        otherwise, nothing registered); returns the host it replaced."""
        await checked(host, self.timeouts.status_s)
        return self.register(host)

    async def discover_http(self, candidates: Sequence[Host]) -> tuple[list[str], list[str]]:
        """Register the candidates that are participants; (registered, skipped).

        A 404 on status is "not a participant" (skipped, closed); any other
        failure or a kind mismatch raises `CoordinationFailed` naming each,
        and none is registered."""
        try:
            found, skipped = await discover_candidates(candidates, self.timeouts.status_s)
        except BaseException:
            for h in candidates:
                await self.drop_host(h)
            raise
        for h in skipped:
            await self.drop_host(h)
        for h in found:
            await self.drop_host(self.register(h))
        return sorted(h.member.key for h in found), sorted(h.member.key for h in skipped)

    def members(self) -> list[Member]:
        """Everyone registered now (an open checkpoint keeps its own, frozen)."""
        return sorted(h.member for h in self.hosts.values())
