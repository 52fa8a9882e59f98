"""The coordinator's engine: every coordinated operation, without Ray.

`CoordinatorCore` owns them all — a checkpoint (whole, or the split
prepare / commit / resume), restore, retire, forget, status, recovery — and
drives registered hosts (`coordination.reach.hosts`) through their ordered groups
(`coordination.engine.order`).  The `Coordinator` actor wraps one engine and adds
only Ray concerns (discovery by name, recovery when Ray restarts it), so
everything here is unit-tested deterministically with in-process hosts.

An open checkpoint or restore is one `OpenCheckpoint`: its frozen members
(its commit, resume and abort go to exactly these, whoever registers
meanwhile), its phase, stepped only through the phase table
(`coordination.engine.phases`: an illegal step raises), its journal entry, and its
records — the tracing span, the timeline, the metrics and
`status.last_checkpoint`.  Every entry point goes through it, so the split
calls and `checkpoint()` take the same lock, settle the same pending
publish, apply the same membership guard (every trigger no person started is
checked against the last complete Gym, `coordination.engine.baseline`) and leave
the same records: a checkpoint is recorded when it closes.

One coordinated operation runs at a time (the lock); `renew`, `status` and
`durable` may run beside any.  Every failure path resumes whatever an
operation touched — participants in reverse order, past failures, then the
paused trainer and assembler (`coordination.engine.pause`) — and raises
`CoordinationFailed` naming each participant and why.  An asynchronous
checkpoint (`durability="async"`) resumes once every participant captured
its records; its writes are confirmed and its Gym manifest written after,
off the lock (`PendingWrites`), and the next operation waits for it, so
`LATEST` never goes back in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any

from coordination.engine.baseline import GymBaseline, Trigger
from coordination.engine.calls import (
    coordination_failed,
    episode_body,
    new_id,
    reply_timeout,
)
from coordination.engine.epoch import CoordinatorEpoch
from coordination.engine.fanout import Outcome, failure, fan_out
from coordination.engine.host import Host, PauseTarget
from coordination.engine.journal import Journal, JournalEntry, JournalStore, encode
from coordination.engine.manifests import (
    DirectoryGuard,
    LatestWriter,
    ManifestReader,
    ManifestWriter,
    read_listed,
    read_listed_or_participants,
    write_gym_manifest_from_replies,
)
from coordination.engine.membership import checked, discover_candidates
from coordination.engine.metrics import CoordinatorMetrics
from coordination.engine.options import CheckpointOptions
from coordination.engine.order import (
    Member,
    commit_groups,
    forget_groups,
    prepare_groups,
    restore_groups,
    resume_groups,
    retire_groups,
)
from coordination.engine.pause import ControllerPauses
from coordination.engine.phases import (
    RETIRE_OPEN,
    CoordinatorEvent,
    CoordinatorPhase,
    Effect,
    Step,
    step,
)
from coordination.engine.renewer import LeaseRenewer
from coordination.engine.replies import (
    as_mapping,
    int_or_none,
    report_of,
    string_list,
)
from coordination.engine.results import (
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
    Timeouts,
)
from coordination.engine.roots import (
    precreate_participant_dirs,
    ready_for_checkpoint,
    write_latest_quietly,
)
from coordination.engine.status import participant_rows
from coordination.engine.timeline import COORDINATOR_ROW, HistoryStore, TimelineRecorder
from ray_ckpt import tracing
from ray_ckpt.clock import SYSTEM_CLOCK, Clock, SystemClock
from ray_ckpt.errors import (
    CheckpointConflict,
    CheckpointError,
    CoordinationFailed,
    DeadlineExceeded,
    InvalidCheckpointState,
    InvalidPhase,
    InvalidRequest,
    ParticipantNotFresh,
    RestartInScope,
    StaleCoordinator,
)
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.blobstore.locations import split_location
from ray_ckpt.storage.root.gym_manifest import GymManifest
from ray_ckpt.storage.root.history import RestartBias, progress_from, restart_bias
from ray_ckpt.tracing import SpanRecord, SpanSink

log = logging.getLogger(__name__)

P, E = CoordinatorPhase, CoordinatorEvent

# The episodes a checkpoint without a scope continues (the assembler's in flight).
ScopeSource = Callable[[], Awaitable[Sequence[EpisodeId]]]
# Directories remembered as possibly still written into by a failed checkpoint.
KEPT_LATE = 64
# Checkpoints whose opening order is remembered for the `LATEST` check: far
# more than can be pending at once (`PendingWrites.KEPT`).
ORDER_KEPT = 64


# --- one open checkpoint or restore ---------------------------------------------------


class OpenCheckpoint:
    """One checkpoint or restore from its opening to its close.

    What the engine needs of it between calls — the members frozen at its
    opening, the phase, the journal entry, what each phase answered — and
    what is recorded of it when it closes.  `checkpoint_id`, `op` and
    `phase` read like the journal entry's (the status and the tests read
    them)."""

    def __init__(
        self,
        engine: CoordinatorCore,
        op: str,
        checkpoint_id: str,
        members: Mapping[str, Host],
        *,
        trigger: str = Trigger.MANUAL.value,
        checkpoint_dir: str | None = None,
        episode_ids: Sequence[str] = (),
        phase: CoordinatorPhase = P.IDLE,
    ) -> None:
        self.engine = engine
        self.entry = JournalEntry(
            checkpoint_id=checkpoint_id,
            phase=phase,
            op=op,
            checkpoint_dir=checkpoint_dir,
            episode_ids=list(episode_ids),
        )
        self.members: dict[str, Host] = dict(members)
        self.trigger = trigger
        self.started = time.monotonic()
        # What each step answered, for the result and the record at the close.
        self.prepared: PrepareResult | None = None
        self.committed: CommitResult | None = None
        # As recorded when it closed (a checkpoint that completed).
        self.result: CheckpointResult | None = None
        self.scope: list[EpisodeId] | None = None
        # Restart-only episodes the prepare reported, by capture key.
        self.prepare_restarts: set[str] = set()
        # Why it failed (set before the abort that closes it); None: not failed.
        self.error: BaseException | None = None
        # Found open in the journal by a restarted coordinator, and aborted.
        self.recovered = False
        self.closed = False
        # A restore: the checkpoint ID of the directory it installs.
        self.source_id: str | None = None
        self._span = tracing.start(
            f"ray_ckpt.{op}", {"ray_ckpt.trigger": trigger, "ray_ckpt.id": checkpoint_id}
        )

    @property
    def checkpoint_id(self) -> str:
        return self.entry.checkpoint_id

    @property
    def op(self) -> str:
        return self.entry.op

    @property
    def phase(self) -> CoordinatorPhase:
        return self.entry.phase

    @property
    def checkpoint_dir(self) -> str | None:
        return self.entry.checkpoint_dir

    @property
    def episode_ids(self) -> list[str]:
        return self.entry.episode_ids

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Its tracing span, current for the calls made inside (each entry point's)."""
        with tracing.within(self._span):
            yield

    async def fire(self, event: CoordinatorEvent, **changes: Any) -> Step:
        """Take the step the phase table gives `event`, then carry out its effects."""
        done = step(self.phase, event)
        for name, value in changes.items():
            setattr(self.entry, name, value)
        self.entry.phase = done.after
        await self.engine._apply(self, done)
        return done

    def end_span(self, outcome: str) -> None:
        tracing.end(self._span, {"ray_ckpt.outcome": outcome})


# --- asynchronous checkpoints still publishing ------------------------------------------


class PendingWrites:
    """The asynchronous checkpoints not yet durable (and the last few that are)."""

    KEPT = 8

    def __init__(self) -> None:
        self._tasks: OrderedDict[str, asyncio.Task[DurableResult]] = OrderedDict()

    def add(self, cid: str, task: asyncio.Task[DurableResult]) -> None:
        # Retrieved (the failure reported) by `durable()`; never "never retrieved".
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._tasks[cid] = task
        while len(self._tasks) > self.KEPT and next(iter(self._tasks.values())).done():
            self._tasks.popitem(last=False)

    async def durable(self, cid: str) -> DurableResult:
        task = self._tasks.get(cid)
        if task is None:
            raise InvalidRequest(
                f"no asynchronous checkpoint {cid!r}: this coordinator keeps the last {self.KEPT}"
            )
        return await asyncio.shield(task)

    async def settle(self) -> None:
        """Wait for every pending one (their outcome goes to their `durable()`)."""
        running = [t for t in self._tasks.values() if not t.done()]
        if running:
            await asyncio.wait(running)

    def running(self) -> list[str]:
        return [cid for cid, t in self._tasks.items() if not t.done()]

    async def aclose(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()))


# --- the engine -------------------------------------------------------------------------


class CoordinatorCore:
    def __init__(
        self,
        *,
        clock: Clock = SYSTEM_CLOCK,
        journal: JournalStore | None = None,
        timeouts: Timeouts | None = None,
        manifest_writer: ManifestWriter = write_gym_manifest_from_replies,
        manifest_reader: ManifestReader = read_listed,
        unlisted_reader: ManifestReader = read_listed_or_participants,
        latest_writer: LatestWriter | None = write_latest_quietly,
        directory_guard: DirectoryGuard | None = ready_for_checkpoint,
        pause_mode: str = "full",
        metrics: CoordinatorMetrics | None = None,
        history: HistoryStore | None = None,
        epoch: CoordinatorEpoch | None = None,
    ) -> None:
        self.clock = clock
        # This coordinator's fencing token (`coordination.engine.epoch`): sent
        # with every control call to a participant that takes it, confirmed
        # before opening and before publishing.  None: no fencing (off Ray).
        # The actor sets it when it starts or recovers, before any call.
        self.epoch = epoch
        # Member key -> the host whose status said it takes epochs (it shows
        # `coordinator_epoch`); only those are sent one, as NeMo Gym's
        # participants refuse a body with a field they do not know.
        self._takes_epoch: dict[str, Host] = {}
        # Member key -> the host whose status was read (taking epochs or not);
        # one unreachable at registration is asked again before the next opening.
        self._epoch_known: dict[str, Host] = {}
        self.journal: JournalStore = journal or Journal(None)
        # The last close's journal clear, still running: the next journal
        # write or read waits for it (`settle_journal`).
        self._clearing: asyncio.Future[None] | None = None
        self.timeouts = timeouts or Timeouts()
        self.manifest_writer = manifest_writer
        self.manifest_reader = manifest_reader
        # Only when a restore asks for it (`allow_without_gym_manifest`).
        self.unlisted_reader = unlisted_reader
        # After the Gym manifest: the parent's LATEST (None: no pointer kept).
        self.latest_writer = latest_writer
        # Before a checkpoint commits into a directory: refuse one holding a
        # complete checkpoint, clear an aborted one's leftovers (None: no check).
        self.directory_guard = directory_guard
        # Off Ray a null sink; the actor passes Ray's (`coordination.engine.metrics`).
        self.metrics = metrics or CoordinatorMetrics()
        # Where each checkpoint's timeline is saved, beside its Gym manifest,
        # and each restore's beside its source (None: kept in memory only).
        self.history = history
        self.hosts: dict[str, Host] = {}
        self.open: OpenCheckpoint | None = None
        # Hosts replaced or unregistered while frozen in an open checkpoint:
        # closed once it closes, not under its calls.
        self._to_close: list[Host] = []
        # Member key -> (kind, instance) its last committed manifest named:
        # the folders the next checkpoint creates before it pauses anyone.
        self.layout: dict[str, tuple[str, str]] = {}
        self.lock = asyncio.Lock()
        self.pauses = ControllerPauses(self.timeouts, pause_mode)
        # Each recent checkpoint's and restore's spans (`ray-ckpt timeline`).
        self.timeline = TimelineRecorder()
        # The Gym of the last complete checkpoint or restore, and who was lost
        # since: what every unattended trigger is checked against.
        self.baseline = GymBaseline()
        self.last_checkpoint: LastCheckpoint | None = None
        # Asynchronous checkpoints resumed and not yet published.
        self.pending = PendingWrites()
        self._history_saves: set[asyncio.Task[None]] = set()
        # Directories a checkpoint failed in after its commit was sent: a
        # participant may still write there (a write whose reply was lost),
        # until its next prepare, which waits for that write.  A retry there
        # clears them again after its prepare (`_clear_late_writes`).
        self._late_writes: OrderedDict[str, None] = OrderedDict()
        # Each checkpoint's place in the order this engine opened them, and,
        # per parent, the place of the one its `LATEST` names: a pointer is
        # never moved to a checkpoint opened before the one it names.
        self._opened = 0
        self._order: OrderedDict[str, int] = OrderedDict()
        self._latest_at: dict[str, int] = {}
        self._latest_lock = asyncio.Lock()
        self.renewer = LeaseRenewer(
            self.clock,
            self.timeouts,
            open_id=lambda: self.open.checkpoint_id if self.open is not None else None,
            hosts=lambda: list(self._roster().values()),
            stamp=self.stamped,
            confirm=lambda: self.confirm_epoch("renewing leases"),
            superseded=self._superseded,
        )
        # The abort `_superseded` started, kept so it is not collected mid-way.
        self._superseding: asyncio.Task[None] | None = None

    # The pause state lives in `self.pauses`; these keep the engine's old names.
    @property
    def pause_mode(self) -> str:
        return self.pauses.mode

    @property
    def pausers(self) -> dict[str, PauseTarget]:
        return self.pauses.targets

    @property
    def frozen(self) -> dict[str, Host]:
        """The open checkpoint's members ({} when none is open)."""
        return self.open.members if self.open is not None else {}

    # --- membership -----------------------------------------------------------------
    def register(self, host: Host) -> Host | None:
        """Add or replace `host`; returns the host it replaced, if any."""
        old = self.hosts.get(host.member.key)
        self.hosts[host.member.key] = host
        return old if old is not host else None

    def unregister(self, key: str, *, lost: bool = False) -> Host | None:
        """Drop `key`; `lost`: its process was found gone (not a person's
        choice), which unattended checkpoints refuse until a restore."""
        host = self.hosts.pop(key, None)
        if host is not None and lost:
            self.baseline.member_lost(key)
        return host

    async def drop_host(self, host: Host | None) -> None:
        """Close a replaced or unregistered host, unless the open checkpoint
        still calls it (then it is closed when that checkpoint closes)."""
        if host is None or host in self.hosts.values():
            return
        if any(h is host for h in self.frozen.values()):
            self._to_close.append(host)
            return
        with contextlib.suppress(Exception):
            await host.aclose()

    def register_pause(self, target: PauseTarget, *, mode: str | None = None) -> None:
        self.pauses.register(target, mode=mode)

    def members(self) -> list[Member]:
        """Everyone registered now (an open checkpoint keeps its own, frozen)."""
        return sorted(h.member for h in self.hosts.values())

    async def register_checked(self, host: Host) -> Host | None:
        """Register `host` once its status confirms its kind (`KindMismatch`
        otherwise, nothing registered); returns the host it replaced."""
        self._learn_epoch(host, await checked(host, self.timeouts.status_s))
        return self.register(host)

    async def discover_http(self, candidates: Sequence[Host]) -> tuple[list[str], list[str]]:
        """Register the candidates that are participants; (registered, skipped).

        A 404 on status is "not a participant" (skipped, closed); any other
        failure or a kind mismatch raises `CoordinationFailed` naming each,
        and none is registered."""
        statuses: dict[str, dict[str, Any]] = {}
        try:
            found, skipped = await discover_candidates(candidates, self.timeouts.status_s, statuses)
        except BaseException:
            for h in candidates:
                await self.drop_host(h)
            raise
        for h in skipped:
            await self.drop_host(h)
        for h in found:
            self._learn_epoch(h, statuses.get(h.member.key))
            await self.drop_host(self.register(h))
        return sorted(h.member.key for h in found), sorted(h.member.key for h in skipped)

    # --- the epoch (`coordination.engine.epoch`) -------------------------------------
    def _learn_epoch(self, host: Host, status: Mapping[str, Any] | None) -> None:
        """Whether `host` takes epochs, from its status at registration."""
        if status is not None:
            self._epoch_known[host.member.key] = host
        if status is not None and "coordinator_epoch" in status:
            self._takes_epoch[host.member.key] = host
        elif self._takes_epoch.get(host.member.key) is host:
            del self._takes_epoch[host.member.key]

    async def _learn_epochs(self, hosts: Iterable[Host]) -> None:
        """Read the status of the members no status was read of yet (each was
        unreachable at registration, a slow start say): unasked, one that
        takes epochs would be sent none, and so not fenced by them."""
        if self.epoch is None:
            return
        unknown = [h for h in hosts if self._epoch_known.get(h.member.key) is not h]

        async def one(host: Host) -> None:
            try:
                status = await asyncio.wait_for(host.status(), self.timeouts.status_s)
            except Exception:
                return  # still unknown: asked again before the next opening
            self._learn_epoch(host, as_mapping(status))

        await asyncio.gather(*(one(h) for h in unknown))

    def _superseded(self, error: StaleCoordinator) -> None:
        """The renewer found this coordinator superseded while a checkpoint
        is open: abort it (everyone resumed, the failure recorded) rather
        than keep participants paused that only this one still reaches.
        Under the lock, after whatever operation holds it."""
        oc = self.open

        async def abort() -> None:
            async with self.lock:
                if self.open is oc and oc is not None and not oc.closed:
                    with oc.current():
                        await self._abort(oc, error)

        self._superseding = asyncio.ensure_future(abort())

    def stamped(self, host: Host, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """`body` as sent to `host`: with this coordinator's epoch if it takes one."""
        if self.epoch is None or self._takes_epoch.get(host.member.key) is not host:
            return body
        return {**body, "coordinator_epoch": self.epoch.value}

    async def confirm_epoch(self, what: str) -> None:
        """`StaleCoordinator` unless this coordinator's epoch is still the newest."""
        if self.epoch is not None:
            await self.epoch.confirm(what)

    async def _journal_is_ours(self, what: str) -> bool:
        """Whether this coordinator may still write the journal: the key is
        shared with the incarnation that superseded it (same name), and its
        entry is what that one recovers from.  A stale coordinator's entry is
        dropped, not raised: what it is doing (an abort's resumes, say) goes
        on, refused by the participants that saw the newer epoch."""
        try:
            await self.confirm_epoch("the journal")
        except StaleCoordinator as exc:
            log.warning("journal entry of %s not written: %s", what, exc)
            return False
        return True

    def _roster(self) -> dict[str, Host]:
        """Who an operation talks to: the open checkpoint's frozen members, or
        (nothing open) everyone registered now."""
        return self.open.members if self.open is not None else self.hosts

    def _hosts(self, group: Sequence[Member]) -> list[Host]:
        roster = self._roster()
        return [roster[m.key] for m in group]

    def _members(self) -> list[Member]:
        return [h.member for h in self._roster().values()]

    def _prune_gone(self, out: Outcome) -> None:
        """Drop members whose actor no longer exists (each failed call says so):
        the checkpoint they were in fails naming them, the next one goes
        without them.  A replacement registered under the same key stays."""
        for key in out.errors:
            host = self._roster().get(key)
            if host is not None and host.gone and self.hosts.get(key) is host:
                log.warning("%s no longer exists; dropped from the members", key)
                del self.hosts[key]
                self.baseline.member_lost(key)

    # --- the phase table's effects and the journal ----------------------------------
    async def _open(self, oc: OpenCheckpoint, event: CoordinatorEvent) -> None:
        """`oc` becomes the open operation, by its first step."""
        if self.open is not None:
            raise CheckpointConflict(
                f"checkpoint {self.open.checkpoint_id} is open ({self.open.phase}); resume it first"
            )
        self.open = oc
        try:
            await oc.fire(event)
        except BaseException:
            if self.open is oc and oc.phase is P.IDLE:
                self.open = None  # the first step never happened
            raise

    async def _apply(self, oc: OpenCheckpoint, done: Step) -> None:
        """Carry out what a step of `oc` says (`coordination.engine.phases.Effect`)."""
        for effect in done.effects:
            if effect is Effect.FREEZE_MEMBERS:
                oc.entry.members = {k: h.describe() for k, h in oc.members.items()}
            elif effect in (Effect.JOURNAL, Effect.NOTE):
                oc.entry.updated_at = self.clock.now()
                if effect is Effect.JOURNAL:
                    # The write (a GCS call or an fsync, both blocking) runs in
                    # a thread, and the next fan-out waits for it.
                    await self.settle_journal()
                    if await self._journal_is_ours(oc.checkpoint_id):
                        await asyncio.to_thread(self.journal.write, encode(oc.entry))
            elif effect is Effect.START_RENEWER:
                self.renewer.start(oc.checkpoint_id)
            elif effect is Effect.STOP_RENEWER:
                try:
                    self.renewer.stop()
                except Exception:
                    log.exception("stopping the lease renewer raised")
            elif effect is Effect.CLEAR_JOURNAL:
                self._clear_journal()
            elif effect is Effect.RECORD_BASELINE:
                self.baseline.record(oc.members)

    def _clear_journal(self) -> None:
        """Nothing open any more.  Not waited for: the operation is over and
        its caller answered at once.  A coordinator that dies before the
        clear lands leaves an entry whose recovery resumes participants that
        already resumed, which they answer as done.  The next write waits for
        the clear first, so the two never land out of order."""
        previous = self._clearing

        async def clear() -> None:
            if previous is not None:
                with contextlib.suppress(Exception):
                    await previous
            if await self._journal_is_ours("the close"):
                await asyncio.to_thread(self.journal.clear)

        self._clearing = asyncio.ensure_future(clear())

    async def settle_journal(self) -> None:
        """Wait for a clear still running; its failure is logged, not raised
        (the next write replaces the entry it failed to clear)."""
        clearing = self._clearing
        if clearing is None:
            return
        try:
            await asyncio.shield(clearing)  # a cancelled waiter leaves it pending
        except Exception:
            log.exception("could not clear the journal; the next entry replaces it")
        if self._clearing is clearing:
            self._clearing = None

    # --- group calls ----------------------------------------------------------------
    async def _group(
        self, group: Sequence[Member], op: str, body: Mapping[str, Any], deadline_ts: float
    ) -> Outcome:
        """One group's calls, together, under the deadline (plus the reply grace)."""
        if op in ("prepare", "commit"):
            self.renewer.raise_floor(deadline_ts)
        timeout = reply_timeout(self.clock, self.timeouts, deadline_ts)
        out = await fan_out(self._hosts(group), op, lambda h: self.stamped(h, body), timeout)
        self._prune_gone(out)
        cid = str(body.get("checkpoint_id", ""))
        if cid:
            spans = self._spans(cid)
            for key, record in out.spans.items():
                # The calls' own spans: the traces' and the metrics' timings too.
                spans(record)
                reply = out.replies.get(key)
                if reply is not None:
                    self.timeline.reported(cid, key, reply.get("spans"))
        return out

    # --- checkpoint: the entry points -------------------------------------------------
    async def checkpoint(
        self,
        options: CheckpointOptions | str,
        scope: Sequence[EpisodeId] | None = None,
        *,
        scope_source: ScopeSource | None = None,
        **fields: Any,
    ) -> CheckpointResult:
        """prepare → commit → Gym manifest → resume (unless kept open to publish).

        `options` (`CheckpointOptions`), or the directory with the other
        options as keywords.  `durability="async"`: prepare → commit
        (captured) → resume, returned `pending`; every write durable and then
        the Gym manifest follow in the background (`durable(checkpoint_id)`).
        Without a scope, `scope_source` (the assembler's in-flight episodes)
        is asked after the prepare, while the assembler is paused.
        `total_s`: the whole checkpoint's budget from the call (waiting for
        the lock included): the phase deadlines are cut to fit it, and a
        checkpoint not ready to publish inside it fails whole (no Gym
        manifest, no `LATEST`)."""
        opts = _options(options, scope, fields).check()
        publish_by = None if opts.total_s is None else self.clock.now() + opts.total_s
        start = time.monotonic()
        async with self.lock:
            try:
                await self._before_opening(opts.trigger, opts.checkpoint_dir)
                prepare_s = opts.prepare_s
                if publish_by is not None:
                    prepare_s = self._fit(prepare_s, self.timeouts.prepare_s, publish_by)
            except Exception as exc:
                # Refused before anything opened: recorded here (once it
                # opened, its close records it, whatever ends it).
                self.metrics.checkpoint_failed(exc, time.monotonic() - start, opts.trigger)
                raise
            # The folders are made while the prepare runs (see
            # `precreate_participant_dirs`): the commit, not the prepare,
            # needs them, and their fsyncs then cost the cycle nothing.
            known = [self.layout[k] for k in sorted(self.hosts) if k in self.layout]
            folders = (
                asyncio.ensure_future(
                    asyncio.to_thread(precreate_participant_dirs, opts.checkpoint_dir, known)
                )
                if known
                else None
            )
            try:
                oc = await self._prepare(prepare_s, opts.trigger)
            finally:
                if folders is not None:
                    await folders  # never raises: a failure is logged
            with oc.current():
                await self._clear_late_writes(oc, opts.checkpoint_dir)
                scope = opts.scope
                if scope is None and scope_source is not None:
                    scope = await self._asked_scope(oc, scope_source)
                committed = await self._commit(
                    oc, opts, scope, publish_by=publish_by, defer_latest=opts.resume
                )
                if committed.pending:
                    # Written into after the resume: a retry there clears it
                    # after its prepare, until this one is published.
                    self._late_writes_in(opts.checkpoint_dir)
                members = self._hosts(self._members())  # before the resume unfreezes them
                resumed = None
                if opts.resume:
                    if committed.pending:
                        resumed = await self._resume(oc)
                    else:
                        # Complete with its Gym manifest: the pointer is written
                        # while the Gym resumes (one durable replace off the
                        # pause), and both end before the lock is let go, so
                        # LATEST never goes back.
                        resumed, _ = await asyncio.gather(
                            self._resume(oc),
                            self._write_latest(opts.checkpoint_dir, committed.checkpoint_id),
                        )
                if committed.pending:
                    self._confirm_later(oc, opts, scope, members)
                elif not opts.resume:
                    # Complete, yet kept open (a `stop` checkpoint: its caller
                    # exits next, and nothing may ever close it): its timeline
                    # is saved now, or a restore from it could not count its
                    # restart bias.  Once: a later close finds it there.
                    self._note_committed(oc)
                    self.timeline.finish(oc.checkpoint_id, outcome="ok", trigger=oc.trigger)
                    await self._save_history(oc.checkpoint_id, opts.checkpoint_dir)
        # As recorded if it closed; else (kept open to publish) as of now.
        return oc.result or _checkpoint_result(oc, resumed)

    async def prepare(self, deadline_s: float | None = None) -> PrepareResult:
        """Open a checkpoint (the split calls' first): pause the trainer's
        side, prepare group by group.  As in `checkpoint`, an asynchronous
        checkpoint still publishing is waited for first: one opened after it
        never becomes `latest` before it."""
        start = time.monotonic()
        async with self.lock:
            try:
                await self._before_opening(Trigger.MANUAL.value, None)
            except Exception as exc:
                self.metrics.checkpoint_failed(exc, time.monotonic() - start, Trigger.MANUAL.value)
                raise
            oc = await self._prepare(deadline_s, Trigger.MANUAL.value)
        assert oc.prepared is not None
        return oc.prepared

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
        """Commit the open checkpoint everywhere, then write the Gym manifest
        (the split calls' second).

        `strict`: refuse (`RestartInScope`, checkpoint aborted, no Gym
        manifest) if an episode of the scope has no state at any participant;
        not with `stop` (that frees the exported episodes' resources first).
        `scope_source`: asked for the scope when none is given."""
        async with self.lock:
            await self.pending.settle()  # none may still write into `checkpoint_dir`
            oc = self.open
            if oc is None or oc.op != "checkpoint" or oc.phase not in (P.PREPARED, P.COMMITTING):
                raise CheckpointConflict("no prepared checkpoint is open: prepare first")
            opts = CheckpointOptions(
                checkpoint_dir=checkpoint_dir,
                scope=None if scope is None else list(scope),
                stop=stop,
                strict=strict,
                commit_s=deadline_s,
                resume=False,
            ).check()
            with oc.current():
                if oc.phase is P.PREPARED:
                    # Refused (the checkpoint stays prepared: commit elsewhere
                    # or resume) before any participant writes into a complete one.
                    try:
                        await self._guard_directory(checkpoint_dir)
                    except StaleCoordinator as exc:
                        # Superseded: this checkpoint can never be published, so
                        # everyone is resumed now, not kept paused (and renewed)
                        # while this coordinator runs on.
                        await self._abort(oc, exc)
                        raise
                    await self._clear_late_writes(oc, checkpoint_dir)
                if scope is None and scope_source is not None:
                    scope = await self._asked_scope(oc, scope_source)
                return await self._commit(oc, opts, scope, publish_by=None, defer_latest=False)

    async def resume(self, deadline_s: float | None = None) -> ResumeResult:
        """Close (or abort) the open checkpoint or restore; idempotent.  The
        resume of a restore left open fails it whole if a participant lost
        restored state since its install (`restored_state_lost`)."""
        async with self.lock:
            oc = self.open
            if oc is None:
                return ResumeResult(checkpoint_id=None, seconds=0.0)
            with oc.current():
                return await self._resume(oc, deadline_s)

    async def renew(self) -> dict[str, float | None]:
        return await self.renewer.renew()

    async def durable(self, cid: str) -> DurableResult:
        """The asynchronous checkpoint `cid` once published; raises its failure."""
        return await self.pending.durable(cid)

    # --- checkpoint: the steps (lock held) ---------------------------------------------
    async def _before_opening(self, trigger: str, checkpoint_dir: str | None) -> None:
        """What every entry point that opens a checkpoint does first: the
        asynchronous checkpoint before it publishes (so `LATEST` never goes
        back in time; the participants' prepare would wait for its writes
        anyway), the membership guard (before anyone is paused), and the
        directory made ready (after the settle: nothing writes there any more)."""
        if self.open is not None:
            raise CheckpointConflict(
                f"checkpoint {self.open.checkpoint_id} is open ({self.open.phase}); resume it first"
            )
        if not self.hosts:
            raise InvalidRequest("no participants are registered")
        await self.pending.settle()
        await self.settle_history()
        # A superseded coordinator pauses nobody (nothing opened yet).
        await self.confirm_epoch("opening a checkpoint")
        await self._learn_epochs(self.hosts.values())
        self.baseline.check(self.hosts, trigger)
        if checkpoint_dir is not None:
            await self._guard_directory(checkpoint_dir)

    async def _prepare(self, deadline_s: float | None, trigger: str) -> OpenCheckpoint:
        """Open a checkpoint and prepare every member, group by group (after
        `_before_opening`); whatever fails from here aborts it, and its close
        records it."""
        start = time.monotonic()
        cid = new_id("ckpt")
        self._note_opened(cid)  # its place in the order `LATEST` keeps
        deadline_s = self.timeouts.prepare_s if deadline_s is None else deadline_s
        deadline_ts = self.clock.now() + deadline_s
        oc = OpenCheckpoint(self, "checkpoint", cid, self.hosts, trigger=trigger)
        members = [h.member for h in oc.members.values()]
        # From here on whatever raises (a participant's reply, a pause target, a
        # bug of ours, the journal) aborts: every member is resumed before the
        # error leaves, and nothing stays open.
        with oc.current():
            async with self._aborting(oc):
                await self._open(oc, E.OPEN)
                sink = self._spans(cid) if self.pauses.targets else None
                with tracing.recorded("pause callers", COORDINATOR_ROW, sink):
                    await self.pauses.pause(cid, self.pauses.prepare_roles(), deadline_s)
                body = {"checkpoint_id": cid, "deadline_ts": deadline_ts}
                timings: dict[str, float] = {}
                restarts: dict[str, list[str]] = {}
                for group in prepare_groups(members):
                    out = await self._group(group, "prepare", body, deadline_ts)
                    timings.update(out.timings)
                    failures = {k: failure(e) for k, e in out.errors.items()}
                    for key, reply in out.replies.items():
                        report = report_of(reply)
                        if string_list(report.get("restarts")):
                            restarts[key] = string_list(report.get("restarts"))
                        if reply.get("phase") != "prepared":
                            err = DeadlineExceeded(
                                f"{key} is not prepared at the deadline "
                                f"(phase {reply.get('phase')})"
                            )
                            failures[key] = failure(err, report)
                    if failures:
                        raise coordination_failed("prepare", cid, failures)
                await oc.fire(E.PREPARED)
        oc.prepare_restarts = {k for keys in restarts.values() for k in keys}
        seconds = time.monotonic() - start
        log.info("prepare %s: %d participants in %.3fs", cid, len(timings), seconds)
        oc.prepared = PrepareResult(
            checkpoint_id=cid, seconds=seconds, timings=timings, restarts=restarts
        )
        return oc

    async def _commit(
        self,
        oc: OpenCheckpoint,
        opts: CheckpointOptions,
        scope: Sequence[EpisodeId] | None,
        *,
        publish_by: float | None,
        defer_latest: bool,
    ) -> CommitResult:
        """Commit the prepared checkpoint everywhere, then the Gym manifest.

        Then the parent's LATEST pointer, unless `defer_latest`: a caller that
        resumes at once writes it alongside the resume (`_write_latest`),
        since the checkpoint is complete with its Gym manifest.

        `publish_by` (the clock's time): the latest the Gym manifest may start
        being written.  Past it the checkpoint fails whole (`DeadlineExceeded`,
        records left unpublished, everyone resumed), so a checkpoint bounded by
        a grace budget never becomes `latest` after the caller gave up on it."""
        checkpoint_dir = opts.checkpoint_dir
        cid = oc.checkpoint_id
        start = time.monotonic()
        deadline_s = self.timeouts.commit_s if opts.commit_s is None else opts.commit_s
        deadline_ts = self.clock.now() + deadline_s
        if publish_by is not None:
            deadline_ts = min(deadline_ts, publish_by)
        asynchronous = opts.durability == "async"
        oc.scope = None if scope is None else list(scope)
        with self._writing_into(checkpoint_dir):
            async with self._aborting(oc, abort=asynchronous):
                await oc.fire(E.COMMIT, checkpoint_dir=checkpoint_dir)
                body: dict[str, Any] = {
                    "checkpoint_id": cid,
                    "deadline_ts": deadline_ts,
                    "checkpoint_dir": checkpoint_dir,
                    "episode_ids": None if scope is None else [episode_body(e) for e in scope],
                    "stop": opts.stop,
                }
                if asynchronous:
                    body["durability"] = "async"  # only then: older participants forbid it
                barrier = self.pauses.commit_roles()
                out = Outcome()
                try:
                    await self.pauses.pause(cid, barrier, deadline_s)
                    for group in commit_groups(self._members()):
                        out.merge(await self._group(group, "commit", body, deadline_ts))
                finally:
                    await self.pauses.unpause(cid, barrier)
                if out.errors:
                    if opts.strict and all(
                        isinstance(e, RestartInScope) for e in out.errors.values()
                    ):
                        # The same cause as the strict check below (an episode of
                        # the scope would start over), refused by the participants
                        # themselves (restart-only ones fail closed): the same error.
                        refused = "; ".join(
                            f"{k}: {e.detail}" for k, e in sorted(out.errors.items())
                        )
                        raise RestartInScope(f"commit of {cid} refused (strict): {refused}")
                    raise coordination_failed(
                        "commit", cid, {k: failure(e) for k, e in out.errors.items()}
                    )
                exported = {k: string_list(r.get("episode_ids")) for k, r in out.replies.items()}
                self.timeline.note(cid, progress=progress_from(out.replies))
                continued, restart = split_continued(scope, exported, oc.prepare_restarts)
                if opts.strict and restart:
                    # Before the Gym manifest: the records written stay unpublished.
                    raise RestartInScope(
                        f"commit of {cid} refused (strict): no participant holds state for "
                        f"{restart}; they would start over"
                    )
                if asynchronous:
                    # Captured, not yet durable: no Gym manifest until every
                    # write is (`_confirm_later`, after the resume).
                    await oc.fire(E.CAPTURED)
                    oc.committed = CommitResult(
                        checkpoint_id=cid,
                        checkpoint_dir=checkpoint_dir,
                        seconds=time.monotonic() - start,
                        manifest_s=0.0,
                        timings=out.timings,
                        # Unknown, not 0: nothing is written yet, and the copies
                        # are measured by the writes after the resume
                        # (`DurableResult` gives both sizes).
                        bytes={k: None for k in out.replies},
                        episode_ids=exported,
                        continued=continued,
                        restart=restart,
                        pending=True,
                    )
                    return oc.committed
                manifests = [
                    dict(as_mapping(r.get("manifest"))) for _, r in sorted(out.replies.items())
                ]
                self._learn_layout(out.replies)
                late = None if publish_by is None else self.clock.now() - publish_by
                if late is not None and late > 0:
                    late_err = DeadlineExceeded(
                        f"checkpoint {cid} not ready to publish inside its overall deadline "
                        f"({late:.2f}s late); its records stay unpublished"
                    )
                    raise coordination_failed("commit", cid, {"gym-manifest": failure(late_err)})
                m_start = time.monotonic()
                listed = await self._publish(cid, checkpoint_dir, manifests)
                if not defer_latest:
                    await self._write_latest(checkpoint_dir, cid)
                manifest_s = time.monotonic() - m_start
                await oc.fire(E.PUBLISHED)
        seconds = time.monotonic() - start
        written = {k: manifest_bytes(r.get("manifest"), listed) for k, r in out.replies.items()}
        log.info(
            "commit %s: %d participants, %d bytes in %.3fs (Gym manifest %.3fs)",
            cid,
            len(written),
            sum(written.values()),
            seconds,
            manifest_s,
        )
        oc.committed = CommitResult(
            checkpoint_id=cid,
            checkpoint_dir=checkpoint_dir,
            seconds=seconds,
            manifest_s=manifest_s,
            timings=out.timings,
            bytes=written,
            episode_ids=exported,
            continued=continued,
            restart=restart,
        )
        return oc.committed

    async def _publish(
        self, cid: str, checkpoint_dir: str, manifests: list[dict[str, Any]]
    ) -> GymManifest | None:
        """The Gym manifest, last of all: the commit point of the whole checkpoint.

        Only by the newest coordinator: its epoch is confirmed first, and a
        stale one raises `StaleCoordinator` (the checkpoint fails, unpublished)."""
        await self.confirm_epoch(f"the Gym manifest of {cid}")
        try:
            with tracing.recorded("publish", COORDINATOR_ROW, self._spans(cid)):
                listed = await asyncio.to_thread(
                    self.manifest_writer, checkpoint_dir, cid, manifests
                )
        except Exception as exc:
            err = exc if isinstance(exc, CheckpointError) else CheckpointError(repr(exc))
            raise coordination_failed("commit", cid, {"gym-manifest": failure(err)}) from None
        return listed if isinstance(listed, GymManifest) else None

    async def _asked_scope(self, oc: OpenCheckpoint, source: ScopeSource) -> list[EpisodeId]:
        """The scope from `source`; if it fails, the open checkpoint is aborted."""
        try:
            return list(await source())
        except BaseException as exc:
            if not isinstance(exc, Exception):
                await self._abort(oc, exc)
                raise
            err = exc if isinstance(exc, CheckpointError) else CheckpointError(repr(exc)[:500])
            failed = coordination_failed("commit", oc.checkpoint_id, {"assembler": failure(err)})
            await self._abort(oc, failed)
            raise failed from None

    def _fit(self, asked: float | None, default: float, publish_by: float) -> float:
        """A phase deadline cut to what is left before `publish_by`."""
        left = publish_by - self.clock.now()
        if left <= 0:
            raise DeadlineExceeded("the checkpoint's overall deadline passed before it began")
        return min(default if asked is None else asked, left)

    def _learn_layout(self, replies: Mapping[str, Mapping[str, Any]]) -> None:
        """Remember each member's (kind, instance) from its commit's manifest."""
        for key, reply in replies.items():
            manifest = as_mapping(reply.get("manifest"))
            kind, instance = manifest.get("kind"), manifest.get("instance")
            if isinstance(kind, str) and isinstance(instance, str):
                self.layout[key] = (kind, instance)

    # --- the directory a checkpoint writes into -------------------------------------------
    async def _guard_directory(self, checkpoint_dir: str) -> None:
        """The directory guard (`ready_for_checkpoint` deletes what an aborted
        checkpoint left), only by the newest coordinator: a superseded one
        still running would delete what the newer one is committing into
        the same directory (a trainer's retry names the same one)."""
        if self.directory_guard is not None:
            await self.confirm_epoch(f"clearing {checkpoint_dir}")
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

    async def _clear_late_writes(self, oc: OpenCheckpoint, checkpoint_dir: str) -> None:
        """After the prepare of a retry into a directory a failed checkpoint
        wrote into: every participant's earlier write has ended (its prepare
        waited for it), so what landed since the check before the prepare is
        cleared too.  Aborts the open checkpoint if that fails."""
        if checkpoint_dir in self._late_writes:
            async with self._aborting(oc):
                await self._guard_directory(checkpoint_dir)

    # --- LATEST ---------------------------------------------------------------------
    def _note_opened(self, checkpoint_id: str) -> None:
        """`checkpoint_id` opens now: after every checkpoint opened before it."""
        self._opened += 1
        self._order[checkpoint_id] = self._opened
        while len(self._order) > ORDER_KEPT:
            self._order.popitem(last=False)

    async def _write_latest(self, checkpoint_dir: str, checkpoint_id: str) -> None:
        """The LATEST pointer of a checkpoint whose Gym manifest is written.

        Skipped when the pointer names a checkpoint opened after this one (an
        asynchronous checkpoint publishing after a later one did): `LATEST`
        never goes back in time.  One write at a time, so two publishes
        cannot land out of the order they were checked in.  Never raises: the
        checkpoint is complete with its Gym manifest, the pointer is a hint."""
        if self.latest_writer is None:
            return
        parent = _parent_of(checkpoint_dir)
        async with self._latest_lock:
            try:
                # Complete (its Gym manifest is written), yet not `latest` if
                # a newer coordinator took over since: the pointer is its.
                await self.confirm_epoch(f"LATEST naming {checkpoint_id}")
            except StaleCoordinator as exc:
                log.warning("checkpoint %s is complete; LATEST not moved: %s", checkpoint_dir, exc)
                return
            place = self._order.get(checkpoint_id)
            named = self._latest_at.get(parent)
            if named is not None and (place is None or place < named):
                log.warning(
                    "checkpoint %s is complete; LATEST of %s not moved back to it: "
                    "it names a later checkpoint",
                    checkpoint_dir,
                    parent,
                )
                return
            try:
                await asyncio.to_thread(self.latest_writer, checkpoint_dir, checkpoint_id)
            except Exception:
                log.exception("checkpoint %s is complete; LATEST not updated", checkpoint_dir)
                return
            if place is not None:
                self._latest_at[parent] = place

    # --- asynchronous checkpoints: durable, then published ----------------------------
    def _confirm_later(
        self,
        oc: OpenCheckpoint,
        opts: CheckpointOptions,
        scope: Sequence[EpisodeId] | None,
        members: list[Host],
    ) -> None:
        """After the resume, off the lock: the same commit is sent again to each
        member; each reply waits for that participant's write and carries its
        final manifest (or the write's typed error).  Only when every one is
        durable is the Gym manifest written (and `LATEST` pointed at it): the
        commit point, as in a synchronous checkpoint, just later.  A failed
        write fails the pending checkpoint and publishes nothing; the previous
        complete checkpoint stays `latest`.  A coordinator that dies meanwhile
        publishes nothing either: the directory stays incomplete."""
        cid, checkpoint_dir, trigger = oc.checkpoint_id, opts.checkpoint_dir, opts.trigger
        body = {
            "checkpoint_id": cid,
            "checkpoint_dir": checkpoint_dir,
            "episode_ids": None if scope is None else [episode_body(e) for e in scope],
            "stop": False,
            "durability": "async",
        }
        deadline_s = self.timeouts.commit_s if opts.commit_s is None else opts.commit_s

        async def confirm() -> DurableResult:
            try:
                done = await self._confirm_durable(cid, checkpoint_dir, members, body, deadline_s)
            except Exception as exc:
                self._late_writes_in(checkpoint_dir)  # a write may still be running there
                self.metrics.failed("commit", exc)
                self.timeline.finish(cid, outcome="failed")
                log.warning("asynchronous checkpoint %s not published: %s", cid, exc)
                raise
            self._late_writes.pop(checkpoint_dir, None)
            self.metrics.durable_done(done, trigger)
            last = self.last_checkpoint
            if last is not None and last.checkpoint_id == cid and last.bytes is None:
                import msgspec  # status: its size once durable (None until then)

                self.last_checkpoint = msgspec.structs.replace(last, bytes=done.total_bytes)
            self.timeline.note(cid, bytes=dict(done.bytes), total_bytes=done.total_bytes)
            await self._save_history(cid, checkpoint_dir)
            log.info(
                "durable %s: %d participants, %d bytes, %.3fs after the resume",
                cid,
                len(done.bytes),
                done.total_bytes,
                done.durable_s,
            )
            return done

        self.pending.add(cid, asyncio.ensure_future(confirm()))

    async def _confirm_durable(
        self,
        cid: str,
        checkpoint_dir: str,
        hosts: Sequence[Host],
        body: dict[str, Any],
        deadline_s: float,
    ) -> DurableResult:
        """Every member's write durable, then the Gym manifest; raises `CoordinationFailed`."""
        start = time.monotonic()
        confirm = {**body, "deadline_ts": self.clock.now() + deadline_s}
        out = await fan_out(
            hosts,
            "commit",
            lambda h: self.stamped(h, confirm),
            deadline_s + self.timeouts.reply_grace_s,
        )
        spans = self._spans(cid)
        for record in out.spans.values():
            spans(SpanRecord(record.row, "durable", record.start, record.end, record.ok))
        if out.errors:
            raise coordination_failed("commit", cid, {k: failure(e) for k, e in out.errors.items()})
        manifests = [dict(as_mapping(r.get("manifest"))) for _, r in sorted(out.replies.items())]
        m_start = time.monotonic()
        listed = await self._publish(cid, checkpoint_dir, manifests)
        await self._write_latest(checkpoint_dir, cid)
        written = {k: manifest_bytes(r.get("manifest"), listed) for k, r in out.replies.items()}
        return DurableResult(
            checkpoint_id=cid,
            checkpoint_dir=checkpoint_dir,
            durable_s=time.monotonic() - start,
            manifest_s=time.monotonic() - m_start,
            bytes=written,
            total_bytes=sum(written.values()),
            captured_bytes=sum(
                int_or_none(r.get("captured_bytes")) or 0 for r in out.replies.values()
            ),
        )

    # --- resume, abort, close -----------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _aborting(self, oc: OpenCheckpoint, *, abort: bool = False) -> AsyncIterator[None]:
        """Abort `oc` (resume everyone) if the body raises anything, then
        re-raise; `abort` as for `_resume_everyone`."""
        try:
            yield
        except BaseException as exc:
            if oc.closed or self.open is not oc:
                raise  # its first step never happened, or it is over already
            await self._abort(oc, exc, abort=abort)
            raise

    async def _abort(
        self, oc: OpenCheckpoint, error: BaseException, *, abort: bool = False
    ) -> None:
        """`oc` failed: resume everyone; its close records the failure."""
        if oc.error is None:
            oc.error = error
        if not oc.closed and self.open is oc:
            await self._resume(oc, abort=abort)

    async def _resume(
        self, oc: OpenCheckpoint, deadline_s: float | None = None, *, abort: bool = False
    ) -> ResumeResult:
        """Resume (or abort) `oc`; never raises for participants.  A restore
        whose resume found restored state lost is undone and fails whole."""
        start = time.monotonic()
        await oc.fire(E.RESUME)
        failures = await self._resume_everyone(oc, deadline_s, abort=abort)
        lost = {k: f for k, f in failures.items() if f.get("code") == "restored_state_lost"}
        if oc.op == "restore" and lost:
            # A participant lost restored state since the install (a worker
            # died): none of the restored attempts may continue anywhere.
            await oc.fire(E.UNDO)
            episodes = [EpisodeId.from_capture_key(k) for k in oc.episode_ids]
            await self._retire_next_attempts(oc, episodes, self.clock.now())
            await self._resume_everyone(oc)
            failed = coordination_failed("restore", oc.checkpoint_id, dict(lost))
            oc.error = oc.error or failed
            await self._close(oc)
            raise failed
        result = ResumeResult(
            checkpoint_id=oc.checkpoint_id, seconds=time.monotonic() - start, failures=failures
        )
        await self._close(oc, result)
        return result

    async def _resume_everyone(
        self, oc: OpenCheckpoint, deadline_s: float | None = None, *, abort: bool = False
    ) -> dict[str, Any]:
        """Participants in reverse order (past failures), then paused controllers.

        Every member, not only those that prepared: a participant the prepare
        never reached still records the ID, so a delayed prepare is refused.
        `abort`: the checkpoint failed after an asynchronous commit captured
        records somewhere; the resume says so, and each participant discards
        its capture instead of writing what nothing will publish.  Only then:
        older participants (and NeMo Gym's) refuse a resume with the field.

        Nothing that raises here stops it: a group whose calls fail (or whose
        fan-out itself raises), a controller that cannot be resumed — each is
        logged and reported, and the next group is still resumed."""
        cid = oc.checkpoint_id
        members = [h.member for h in oc.members.values()]
        deadline_s = self.timeouts.resume_s if deadline_s is None else deadline_s
        deadline_ts = self.clock.now() + deadline_s
        body: dict[str, Any] = {"checkpoint_id": cid, "deadline_ts": deadline_ts}
        if abort:
            body["abort"] = True
        failures: dict[str, Any] = {}
        start = time.monotonic()
        for group in resume_groups(members):
            try:
                out = await self._group(group, "resume", body, deadline_ts)
            except Exception:
                # A bug of ours in the group call must not leave them open:
                # resume each one directly instead.
                log.exception("resume of %s at %s raised", cid, [m.key for m in group])
                out = await self._resume_directly(oc, group, body, deadline_ts)
            failures.update({k: failure(e) for k, e in out.errors.items()})
        try:
            with tracing.recorded(
                "resume callers", COORDINATOR_ROW, self._spans(cid) if self.pauses.targets else None
            ):
                failures.update(await self.pauses.unpause(cid))
        except Exception as exc:
            log.exception("unpausing the controllers after %s raised", cid)
            failures["controllers"] = failure(CheckpointError(f"unpause raised: {exc!r}"[:500]))
        for key, why in failures.items():
            log.warning("resume of %s at %s failed (its lease will lapse): %s", cid, key, why)
        log.info(
            "resume %s: %d participants in %.3fs (%d failed)",
            cid,
            len(members),
            time.monotonic() - start,
            len(failures),
        )
        return failures

    async def _resume_directly(
        self,
        oc: OpenCheckpoint,
        group: Sequence[Member],
        body: Mapping[str, Any],
        deadline_ts: float,
    ) -> Outcome:
        """One resume call per member, one at a time, without the fan-out."""
        out = Outcome()
        for m in group:
            host = oc.members.get(m.key)
            if host is None:
                continue
            timeout = max(deadline_ts - self.clock.now(), 0.0) + self.timeouts.reply_grace_s
            try:
                await asyncio.wait_for(host.call("resume", self.stamped(host, body)), timeout)
            except Exception as exc:
                err = exc if isinstance(exc, CheckpointError) else CheckpointError(repr(exc))
                out.errors[m.key] = err
        return out

    async def _close(self, oc: OpenCheckpoint, resumed: ResumeResult | None = None) -> None:
        """Nothing open any more, in memory even if the journal or a record
        fails; then what is recorded of `oc` (`_record_closed`)."""
        if oc.closed:
            return
        oc.closed = True
        try:
            await oc.fire(E.CLOSED)
        except Exception:
            log.exception("closing %s raised; it is closed regardless", oc.checkpoint_id)
        if self.open is oc:
            self.open = None
        closing, self._to_close = self._to_close, []
        for host in closing:
            with contextlib.suppress(Exception):
                await host.aclose()
        try:
            self._record_closed(oc, resumed)
        except Exception:
            log.exception("recording %s raised", oc.checkpoint_id)
        done = self._note_committed(oc)
        if oc.op == "restore" or (done is not None and not done.pending):
            # An asynchronous checkpoint's is saved once it is published.  In
            # the background: a durable create costs several fsyncs, and the
            # caller (the trainer, waiting on the checkpoint) needs none of
            # them; the next opening, a restore (which reads it) and the close
            # wait for it (`settle_history`).
            task = asyncio.ensure_future(self._save_history(oc.checkpoint_id, oc.checkpoint_dir))
            self._history_saves.add(task)
            task.add_done_callback(self._history_saves.discard)

    def _note_committed(self, oc: OpenCheckpoint) -> CommitResult | None:
        """What `oc`'s commit answered, into its timeline; the commit, if any."""
        done = oc.committed
        if done is not None:
            self.timeline.note(
                oc.checkpoint_id,
                durability="async" if done.pending else "sync",
                bytes={k: n for k, n in done.bytes.items() if n is not None},
                total_bytes=done.total_bytes,
                continued=done.continued,
                restart=done.restart,
            )
        return done

    def _record_closed(self, oc: OpenCheckpoint, resumed: ResumeResult | None) -> None:
        """The metrics, the timeline's outcome, the span and
        `status.last_checkpoint` of a closed checkpoint or restore: the same
        whichever entry points drove it."""
        seconds = time.monotonic() - oc.started
        if oc.recovered:
            # A previous coordinator's, aborted: it neither completed nor failed here.
            self.timeline.finish(oc.checkpoint_id, outcome="aborted")
            oc.end_span("aborted")
            return
        if oc.op == "restore":
            outcome = "failed" if oc.error is not None else "ok"
            if oc.error is not None:
                self.metrics.restore_failed(oc.error, seconds)
            self.timeline.finish(oc.checkpoint_id, outcome=outcome)
            oc.end_span(outcome)
            return
        if oc.error is not None:
            self.metrics.checkpoint_failed(oc.error, seconds, oc.trigger)
            self.timeline.finish(oc.checkpoint_id, outcome="failed", trigger=oc.trigger)
            oc.end_span("failed")
            return
        if oc.committed is None:
            # Resumed before any commit: the trainer called it off.
            self.metrics.checkpoint_aborted(seconds, oc.trigger)
            self.timeline.finish(oc.checkpoint_id, outcome="aborted", trigger=oc.trigger)
            oc.end_span("aborted")
            return
        result = oc.result = _checkpoint_result(oc, resumed, total_s=seconds)
        self.metrics.checkpoint_done(result, oc.trigger)
        self.last_checkpoint = LastCheckpoint(
            checkpoint_id=result.checkpoint_id,
            checkpoint_dir=result.checkpoint_dir,
            finished_at=self.clock.now(),
            total_s=result.total_s,
            bytes=result.total_bytes,
            trigger=oc.trigger,
            episodes=result.episodes,
        )
        self.timeline.finish(oc.checkpoint_id, outcome="ok", trigger=oc.trigger)
        oc.end_span("ok")

    # --- the timeline saved with the checkpoint ----------------------------------------
    def _spans(self, cid: str) -> SpanSink:
        """The sink of `cid`'s span records: its timeline, on this engine's
        clock (the records are on the wall clock)."""

        def add(record: SpanRecord) -> None:
            # On the system clock, exactly the records the traces got.
            if not isinstance(self.clock, SystemClock):
                record = record.shifted(self.clock.now() - time.time())
            self.timeline.add(cid, record)

        return add

    async def settle_history(self) -> None:
        """Wait for the timelines still being saved (`_save_history` never raises)."""
        if self._history_saves:
            await asyncio.wait(list(self._history_saves))

    async def _save_history(self, cid: str, checkpoint_dir: str | None) -> None:
        """A complete checkpoint's timeline beside its Gym manifest, or a
        restore's beside the checkpoint it restored (`history`).  After the
        operation is over, so it costs the Gym no pause; never raises: the
        checkpoint is complete without it (`ray_ckpt.storage.root.history`)."""
        tl = self.timeline.peek(cid)
        if self.history is None or tl is None or checkpoint_dir is None:
            return
        if tl.op == "checkpoint" and tl.outcome != "ok":
            return
        tl.checkpoint_dir = checkpoint_dir
        tl.finished_at = self.clock.now()
        save = self.history.save_restore if tl.op == "restore" else self.history.save_checkpoint
        try:
            await asyncio.to_thread(save, checkpoint_dir, tl)
        except Exception:
            log.warning("timeline of %s not saved in %s", cid, checkpoint_dir, exc_info=True)

    async def _restart_bias(
        self, cid: str, checkpoint_dir: str, episodes: Sequence[EpisodeId], continued: list[str]
    ) -> RestartBias:
        """How the restore's episodes fared, by how far each had got: read off
        the source checkpoint's saved timeline (its scope and each episode's
        progress); without one, progress and losses are unknown."""
        source = None
        if self.history is not None:
            try:
                source = await asyncio.to_thread(self.history.read_checkpoint, checkpoint_dir)
            except Exception:
                log.warning("no readable timeline in %s", checkpoint_dir, exc_info=True)
        bias = restart_bias(
            episodes,
            continued,
            None if source is None else [*source.continued, *source.restart],
            {} if source is None else source.progress,
        )
        self.timeline.note(
            cid,
            restart_bias=bias,
            source_checkpoint_id=None if source is None else source.checkpoint_id,
            continued=continued,
            restart=[e.capture_key for e in episodes if e.capture_key not in set(continued)],
        )
        return bias

    # --- restore --------------------------------------------------------------------
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

        Checked before anyone is touched: the Gym manifest lists exactly the
        registered participants (no more, no fewer) — or, when the caller
        allows a directory without one (NeMo Gym's controller writes none),
        the participant manifests there do, found complete and of one
        checkpoint ID — and every member is fresh.  Then every member
        installs the episodes; on any failure (or any exception of ours) the
        next attempts are retired everywhere and everyone is resumed."""
        episodes = list(episode_ids)
        reader = self.unlisted_reader if allow_without_gym_manifest else self.manifest_reader
        start = time.monotonic()
        oc: OpenCheckpoint | None = None
        try:
            async with self.lock:
                # An asynchronous checkpoint still writing would be committed
                # by participants being restored.
                await self.pending.settle()
                await self.settle_history()  # the restart bias reads a saved timeline
                oc = await self._restore_open(checkpoint_dir, episodes, reader)
                with oc.current():
                    result = await self._restore(oc, checkpoint_dir, episodes, resume, deadline_s)
        except Exception as exc:
            if oc is None:
                self.metrics.restore_failed(exc, time.monotonic() - start)
            raise
        self.metrics.restore_done(result)
        return result

    async def _restore_open(
        self, checkpoint_dir: str, episodes: list[EpisodeId], reader: ManifestReader
    ) -> OpenCheckpoint:
        """Check everything a restore needs, then open it; nothing changed if refused."""
        if self.open is not None:
            raise CheckpointConflict(f"checkpoint {self.open.checkpoint_id} is open")
        await self.confirm_epoch("opening a restore")
        await self._learn_epochs(self.hosts.values())
        # Taken before the manifest read (an await): whoever registers meanwhile
        # is not part of this restore.
        roster = dict(self.hosts)
        if not roster:
            raise InvalidRequest("no participants are registered")
        try:
            source_id, listed = await asyncio.to_thread(reader, checkpoint_dir)
        except CheckpointError as exc:
            raise CoordinationFailed(
                f"restore from {checkpoint_dir}: {exc}",
                operation="restore",
                failures={"gym-manifest": failure(exc)},
            ) from None
        # Checked both ways before touching anyone: a participant the checkpoint
        # does not list would start empty while the others continue, and one it
        # lists that is not here would leave its state uninstalled.
        failures = membership_failures(checkpoint_dir, roster, listed)
        if failures:
            raise coordination_failed("restore", source_id or "?", failures)
        # Before anyone changes anything: a participant that already served
        # refuses the restore, and the undo of a refused restore retires the
        # next attempts of the episodes named, which on a running Gym are its
        # own rollouts in flight.  So a live fleet is refused here.
        stale = await not_fresh(roster, self.timeouts.status_s)
        if stale:
            raise ParticipantNotFresh(
                f"restore from {checkpoint_dir} refused, nothing changed: "
                + "; ".join(f"{k} {why}" for k, why in sorted(stale.items()))
                + ". A restore installs into fresh processes only: restore into a newly "
                "started Gym"
            )
        oc = OpenCheckpoint(
            self,
            "restore",
            new_id("restore"),
            roster,
            checkpoint_dir=checkpoint_dir,
            episode_ids=[e.capture_key for e in episodes],
        )
        oc.source_id = source_id
        return oc

    async def _restore(
        self,
        oc: OpenCheckpoint,
        checkpoint_dir: str,
        episodes: list[EpisodeId],
        resume: bool,
        deadline_s: float | None,
    ) -> RestoreResult:
        cid = oc.checkpoint_id
        members = [h.member for h in oc.members.values()]
        deadline_s = self.timeouts.restore_s if deadline_s is None else deadline_s
        deadline_ts = self.clock.now() + deadline_s
        body = {
            "checkpoint_id": cid,
            "deadline_ts": deadline_ts,
            "checkpoint_dir": checkpoint_dir,
            "episode_ids": [episode_body(e) for e in episodes],
        }
        start = time.monotonic()
        try:
            await self._open(oc, E.RESTORE)
            out = await self._group(restore_groups(members)[0], "restore", body, deadline_ts)
            if out.errors:
                raise coordination_failed(
                    "restore", cid, {k: failure(e) for k, e in out.errors.items()}
                )
            await oc.fire(E.INSTALLED)
        except BaseException as exc:
            # Whatever raised (a participant, or a bug of ours): nobody keeps
            # what it installed, everyone is resumed.
            if self.open is oc:
                oc.error = exc
                await self._undo_restore(oc, episodes, deadline_ts)
            raise
        restored = {k: string_list(r.get("restored")) for k, r in out.replies.items()}
        installed = {k for keys in restored.values() for k in keys}
        log.info(
            "restore %s from %s: %d participants, %d episodes installed in %.3fs",
            cid,
            checkpoint_dir,
            len(restored),
            len(installed),
            time.monotonic() - start,
        )
        continued = [e.capture_key for e in episodes if e.next().capture_key in installed]
        bias = await self._restart_bias(cid, checkpoint_dir, episodes, continued)
        resume_failures: dict[str, Any] = {}
        if resume:
            resume_failures = dict((await self._resume(oc)).failures)
        return RestoreResult(
            checkpoint_id=cid,
            source_checkpoint_id=oc.source_id,
            checkpoint_dir=checkpoint_dir,
            total_s=time.monotonic() - start,
            timings=out.timings,
            restored=restored,
            resumed=resume,
            continued=continued,
            restart=[e.capture_key for e in episodes if e.next().capture_key not in installed],
            resume_failures=resume_failures,
            restart_bias=bias,
        )

    async def _undo_restore(
        self, oc: OpenCheckpoint, episodes: Sequence[EpisodeId], deadline_ts: float
    ) -> None:
        """Retire the next attempts, then resume everyone; continue past failures."""
        await oc.fire(E.UNDO)  # from RESUMING too: a resume that found state lost
        await self._retire_next_attempts(oc, episodes, deadline_ts)
        await self._resume_everyone(oc)
        await self._close(oc)

    async def _retire_next_attempts(
        self, oc: OpenCheckpoint, episodes: Sequence[EpisodeId], deadline_ts: float
    ) -> None:
        """Retired everywhere, not only where the install finished: a restore
        that timed out may still install, and the same mark everywhere tells
        the trainer one attempt number to start those rollouts over with."""
        if not episodes:
            return
        cid = oc.checkpoint_id
        cleanup_ts = max(deadline_ts, self.clock.now() + self.timeouts.cleanup_min_s)
        body = {
            "checkpoint_id": cid,
            "deadline_ts": cleanup_ts,
            "episode_ids": [episode_body(e.next()) for e in episodes],
        }
        for group in retire_groups([h.member for h in oc.members.values()]):
            try:
                out = await self._group(group, "retire", body, cleanup_ts)
            except Exception:
                # Retired or not, everyone must still be resumed after.
                log.exception("cleanup retire of %s at %s raised", cid, group)
                continue
            for key, err in out.errors.items():
                log.warning("cleanup retire of %s at %s failed: %s", cid, key, err)

    # --- retire / forget --------------------------------------------------------------
    def _idle_operation_id(self, op: str) -> str:
        oc = self.open
        if oc is None:
            # Fresh every time: any resumed ID is stale at every participant.
            return new_id(op)
        if oc.op == "restore" and oc.phase in RETIRE_OPEN:
            return oc.checkpoint_id  # right after a restore the participants expect its ID
        raise InvalidPhase(
            f"checkpoint {oc.checkpoint_id} is open ({oc.phase}): resume it, then {op}"
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

    # --- status / recovery ------------------------------------------------------------
    async def status(self) -> CoordinatorStatus:
        rows = await participant_rows(self.hosts.values(), self.timeouts.status_s)
        oc = self.open
        return CoordinatorStatus(
            open_checkpoint=oc.checkpoint_id if oc else None,
            phase=oc.phase.value if oc else None,
            pause_mode=self.pauses.mode,
            controllers=sorted(self.pauses.targets),
            participants=rows,
            last_checkpoint=self.last_checkpoint,
            now=self.clock.now(),
            epoch=None if self.epoch is None else self.epoch.value,
        )

    async def recover(self) -> str | None:
        """Abort what a previous coordinator left open (from the journal); idempotent."""
        async with self.lock:
            await self.settle_journal()
            entry = self.journal.load()
            if entry is None:
                return None
            log.warning(
                "recovering %s left %s by a previous coordinator", entry.checkpoint_id, entry.phase
            )
            # Its members as journalled, those that could be found again (a
            # member not found is covered by its lease).
            oc = OpenCheckpoint(
                self,
                entry.op,
                entry.checkpoint_id,
                {k: h for k, h in self.hosts.items() if k in entry.members},
                checkpoint_dir=entry.checkpoint_dir,
                episode_ids=entry.episode_ids,
            )
            oc.recovered = True
            with oc.current():
                if entry.op == "restore" and entry.phase is P.RESTORING:
                    await self._open(oc, E.RECOVER_INSTALL)
                    episodes = [EpisodeId.from_capture_key(k) for k in entry.episode_ids]
                    await self._undo_restore(oc, episodes, self.clock.now())
                else:
                    await self._open(oc, E.RECOVER)
                    await self._resume_everyone(oc)
                    await self._close(oc)
            return entry.checkpoint_id

    async def aclose(self) -> None:
        await self.pending.aclose()  # unpublished: the directories stay incomplete
        await self.settle_history()
        self.renewer.stop()
        await self.settle_journal()
        for host in list(self.hosts.values()):
            with contextlib.suppress(Exception):
                await host.aclose()


# --- the pure pieces of the steps -------------------------------------------------------


def _options(
    options: CheckpointOptions | str, scope: Sequence[EpisodeId] | None, fields: Mapping[str, Any]
) -> CheckpointOptions:
    """The options of a `checkpoint` call given either way."""
    if isinstance(options, CheckpointOptions):
        if scope is not None or fields:
            raise InvalidRequest(
                "give the checkpoint's options as one CheckpointOptions or as keywords, not both"
            )
        return options
    try:
        return CheckpointOptions(
            checkpoint_dir=options, scope=None if scope is None else list(scope), **fields
        )
    except TypeError as exc:
        raise InvalidRequest(f"checkpoint options: {exc}") from None


def _checkpoint_result(
    oc: OpenCheckpoint, resumed: ResumeResult | None, *, total_s: float | None = None
) -> CheckpointResult:
    prepared, committed = oc.prepared, oc.committed
    assert prepared is not None
    assert committed is not None
    timings: dict[str, dict[str, float]] = {}
    for op, table in (("prepare", prepared.timings), ("commit", committed.timings)):
        for key, seconds in table.items():
            timings.setdefault(key, {})[op] = seconds
    return CheckpointResult(
        checkpoint_id=prepared.checkpoint_id,
        checkpoint_dir=committed.checkpoint_dir,
        total_s=time.monotonic() - oc.started if total_s is None else total_s,
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
        durability="async" if committed.pending else "sync",
        pending=committed.pending,
    )


def manifest_bytes(manifest: Any, listed: GymManifest | None = None) -> int:
    """Bytes a participant wrote: its records object's size as the Gym
    manifest `listed` measured it (the writer's return), whichever shape the
    participant manifest has; else what the manifest says (ours carry
    `bytes`; NeMo Gym's do not, and say 0 then).  Plus the attachment blobs
    the checkpoint holds itself (`blob_bytes`; referenced ones were counted
    where they were written), as the listing counts a checkpoint's size.

    NeMo Gym's manifests name their records file, digest and count, never a
    size: only the written object knows it, and the Gym manifest's writer
    has just read it (and checked it against `bytes` where there is one)."""
    m = as_mapping(manifest)
    kind, instance = m.get("kind"), m.get("instance")
    blobs = max(int_or_none(m.get("blob_bytes")) or 0, 0)
    if listed is not None:
        for e in listed.participants:
            if e.kind == kind and e.instance == instance:
                return e.bytes + blobs
    return (int_or_none(m.get("bytes")) or 0) + blobs


def split_continued(
    scope: Sequence[EpisodeId] | None,
    exported: Mapping[str, Sequence[str]],
    prepare_restarts: set[str],
) -> tuple[list[str], list[str]]:
    """(continued, restart) capture keys: an episode continues if some
    participant exported state for it, else it starts over.  Without a
    scope, the episodes are all that were exported plus the restart-only
    ones the prepare reported."""
    held = {k for keys in exported.values() for k in keys}
    wanted = held | prepare_restarts if scope is None else {e.capture_key for e in scope}
    return sorted(wanted & held), sorted(wanted - held)


def membership_failures(
    checkpoint_dir: str, roster: Mapping[str, object], listed: set[tuple[str, str]]
) -> dict[str, dict[str, Any]]:
    """Per participant, why the checkpoint and the registered members differ."""
    listed_keys = {f"{kind}/{instance}" for kind, instance in listed}
    unlisted = InvalidCheckpointState(
        f"registered but not listed in the Gym manifest of {checkpoint_dir}"
    )
    absent = InvalidCheckpointState(
        f"listed in the Gym manifest of {checkpoint_dir} but not registered"
    )
    out = {k: failure(unlisted) for k in roster if k not in listed_keys}
    out.update({k: failure(absent) for k in listed_keys if k not in roster})
    return dict(sorted(out.items()))


async def not_fresh(roster: Mapping[str, Host], timeout_s: float) -> dict[str, str]:
    """Member key -> why it is not fresh, as its status says (`fresh`, live
    executions).  A member whose status does not say (NeMo Gym's), or does
    not answer in time, is left to the restore itself: it checks again."""

    async def one(host: Host) -> str | None:
        try:
            status = await asyncio.wait_for(host.status(), timeout_s)
        except Exception:
            return None
        live = int_or_none(status.get("live_executions")) or 0
        if live > 0:
            return f"has {live} executions live"
        if status.get("fresh") is False:
            return "has served or restored since it started"
        return None

    keys = sorted(roster)
    whys = await asyncio.gather(*(one(roster[k]) for k in keys))
    return {k: why for k, why in zip(keys, whys, strict=True) if why is not None}


def _parent_of(checkpoint_dir: str) -> str:
    """Where `checkpoint_dir`'s `LATEST` lives (itself if it has no parent:
    its writer then fails, logged)."""
    try:
        return split_location(checkpoint_dir)[0]
    except CheckpointError:
        return checkpoint_dir
