"""The checkpoint phases, without Ray: order, deadlines, abort, journal.

`PhaseDriver` (the base of `CoordinatorCore`) drives registered hosts
(`coordination.hosts`) through the ordered phases.  The `Coordinator` actor
only adds Ray around it (discovery by name, recovery on restart), so
everything here is unit-tested with fake hosts.

One coordinated operation runs at a time (a lock); the split
`prepare`/`commit`/`resume` calls keep the open checkpoint between calls.
Every failure path resumes whatever a checkpoint touched — participants in
reverse order, continuing past failures, then the paused controller actors —
and raises `CoordinationFailed` naming each participant and why.

The driver holds membership, the journal, the group calls and the resume
and abort path every operation shares; the forward steps of a checkpoint
(prepare, commit and its Gym manifest) are in `coordination.checkpoint`, as
restore's are in `coordination.restore`.  It delegates pausing the
trainer/assembler to `ControllerPauses` (`coordination.pause`) and keeping
leases alive to `LeaseRenewer` (`coordination.renewer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from coordination import checkpoint
from coordination.baseline import GymBaseline
from coordination.calls import reply_timeout
from coordination.fanout import Outcome, failure, fan_out
from coordination.hosts import Host, PauseTarget
from coordination.journal import Journal, JournalEntry, JournalStore, encode
from coordination.manifests import (
    DirectoryGuard,
    LatestWriter,
    ManifestWriter,
    write_gym_manifest_from_replies,
)
from coordination.order import Member, resume_groups
from coordination.pause import ControllerPauses
from coordination.renewer import LeaseRenewer
from coordination.replies import as_mapping
from coordination.results import CommitResult, PrepareResult, ResumeResult, Timeouts
from coordination.timeline import COORDINATOR_ROW, TimelineRecorder
from ray_ckpt.clock import SYSTEM_CLOCK, Clock
from ray_ckpt.errors import CheckpointError
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.pointer import split_location

log = logging.getLogger(__name__)

# Checkpoints whose opening order is remembered for the `LATEST` check: far
# more than can be pending at once (`async_commit.KEPT`).
ORDER_KEPT = 64


class PhaseDriver:
    def __init__(
        self,
        *,
        clock: Clock = SYSTEM_CLOCK,
        journal: JournalStore | None = None,
        timeouts: Timeouts | None = None,
        manifest_writer: ManifestWriter = write_gym_manifest_from_replies,
        latest_writer: LatestWriter | None = None,
        directory_guard: DirectoryGuard | None = None,
        pause_mode: str = "full",
    ) -> None:
        self.clock = clock
        self.journal: JournalStore = journal or Journal(None)
        # The last close's journal clear, still running: the next journal
        # write or read waits for it (`settle_journal`).
        self._clearing: asyncio.Future[None] | None = None
        self.timeouts = timeouts or Timeouts()
        self.manifest_writer = manifest_writer
        # After the Gym manifest: the parent's LATEST (None: no pointer kept).
        self.latest_writer = latest_writer
        # Before a checkpoint commits into a directory: refuse one holding a
        # complete checkpoint, clear an aborted one's leftovers (None: no check).
        self.directory_guard = directory_guard
        # Each checkpoint's place in the order this driver opened them, and,
        # per parent, the place of the one its `LATEST` names: a pointer is
        # never moved to a checkpoint opened before the one it names.
        self._opened = 0
        self._order: OrderedDict[str, int] = OrderedDict()
        self._latest_at: dict[str, int] = {}
        self._latest_lock = asyncio.Lock()
        # Member key -> (kind, instance) its last committed manifest named:
        # the folders the next checkpoint creates before it pauses anyone.
        self.layout: dict[str, tuple[str, str]] = {}
        self.hosts: dict[str, Host] = {}
        self.open: JournalEntry | None = None
        # The open checkpoint's (or restore's) members, frozen when it opened:
        # its commit, resume and abort go to exactly these, whoever registers,
        # is discovered or is replaced meanwhile.
        self.frozen: dict[str, Host] = {}
        # Hosts replaced or unregistered while frozen in an open checkpoint:
        # closed once it closes, not under its calls.
        self._to_close: list[Host] = []
        # Restart-only episodes the open checkpoint's prepare reported, by key.
        self._prepare_restarts: set[str] = set()
        self.lock = asyncio.Lock()
        self.pauses = ControllerPauses(self.timeouts, pause_mode)
        # Each recent checkpoint's and restore's spans (`ray-ckpt timeline`).
        self.timeline = TimelineRecorder()
        # The Gym of the last complete checkpoint or restore, and who was lost
        # since: what every unattended trigger is checked against.
        self.baseline = GymBaseline()
        self.renewer = LeaseRenewer(
            self.clock,
            self.timeouts,
            open_id=lambda: self.open.checkpoint_id if self.open is not None else None,
            hosts=lambda: list(self._roster().values()),
        )

    # The pause state lives in `self.pauses`; these keep the driver's old names.
    @property
    def pause_mode(self) -> str:
        return self.pauses.mode

    @property
    def pausers(self) -> dict[str, PauseTarget]:
        return self.pauses.targets

    # --- membership ----------------------------------------------------------
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

    def _roster(self) -> dict[str, Host]:
        """Who an operation talks to: the open checkpoint's frozen members, or
        (nothing open) everyone registered now."""
        return self.frozen if self.open is not None else self.hosts

    def _hosts(self, group: Sequence[Member]) -> list[Host]:
        roster = self._roster()
        return [roster[m.key] for m in group]

    def _members(self) -> list[Member]:
        return [h.member for h in self._roster().values()]

    def freeze(self, roster: Mapping[str, Host]) -> None:
        """Fix the members of the checkpoint or restore about to open."""
        self.frozen = dict(roster)

    async def _record(self, entry: JournalEntry | None, *, durable: bool = True) -> None:
        """Note the open checkpoint (or that none is) before the next fan-out.

        The state changes here, on the loop; the write (a GCS call or an
        fsync, both blocking) runs in a thread, and the fan-out waits for it.
        `durable=False` changes only the state in memory: for a step after
        which recovery would do exactly what the journalled phase already
        makes it do (every phase of a checkpoint recovers by resuming
        everyone), a write would only cost the pause a round trip or fsync.

        Clearing (`entry` None) is not waited for: the operation is over and
        its caller answered at once.  A coordinator that dies before the
        clear lands leaves an entry whose recovery resumes participants that
        already resumed that checkpoint, which they answer as done.  The next
        write waits for the clear first, so the two never land out of order."""
        self.open = entry
        if entry is None:
            self.frozen = {}
            self._prepare_restarts = set()
            await self.settle_journal()
            self._clearing = asyncio.ensure_future(asyncio.to_thread(self.journal.clear))
            return
        entry.updated_at = self.clock.now()
        entry.members = {k: h.describe() for k, h in self.frozen.items()}
        if durable:
            await self.settle_journal()
            await asyncio.to_thread(self.journal.write, encode(entry))

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

    async def _group(
        self, group: Sequence[Member], op: str, body: Mapping[str, Any], deadline_ts: float
    ) -> Outcome:
        """One group's calls, together, under the deadline (plus the reply grace)."""
        if op in ("prepare", "commit"):
            self.renewer.raise_floor(deadline_ts)
        timeout = reply_timeout(self.clock, self.timeouts, deadline_ts)
        started, mono = self.clock.now(), time.monotonic()
        out = await fan_out(self._hosts(group), op, lambda h: body, timeout)
        self._prune_gone(out)
        cid = str(body.get("checkpoint_id", ""))
        if cid:
            for key, seconds in out.timings.items():
                # An answered call's own window; a failed one from the group's start.
                began, ended = out.windows.get(key, (mono, mono + seconds))
                self.timeline.span(
                    cid,
                    key,
                    op,
                    started + began - mono,
                    started + ended - mono,
                    ok=key not in out.errors,
                )
                reply = out.replies.get(key)
                if reply is not None:
                    self.timeline.reported(cid, key, reply.get("spans"))
        return out

    # --- checkpoint: prepare and commit (`coordination.checkpoint`) -------------
    async def _prepare(self, deadline_s: float | None = None) -> PrepareResult:
        return await checkpoint.prepare(self, deadline_s)

    async def _commit(
        self,
        checkpoint_dir: str,
        scope: Sequence[EpisodeId] | None = None,
        *,
        stop: bool = False,
        strict: bool = False,
        deadline_s: float | None = None,
        publish_by: float | None = None,
        durability: str = "sync",
        defer_latest: bool = False,
    ) -> CommitResult:
        return await checkpoint.commit(
            self,
            checkpoint_dir,
            scope,
            stop=stop,
            strict=strict,
            deadline_s=deadline_s,
            publish_by=publish_by,
            durability=durability,
            defer_latest=defer_latest,
        )

    def learn_layout(self, replies: Mapping[str, Mapping[str, Any]]) -> None:
        """Remember each member's (kind, instance) from its commit's manifest."""
        for key, reply in replies.items():
            manifest = as_mapping(reply.get("manifest"))
            kind, instance = manifest.get("kind"), manifest.get("instance")
            if isinstance(kind, str) and isinstance(instance, str):
                self.layout[key] = (kind, instance)

    def note_opened(self, checkpoint_id: str) -> None:
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

    # --- resume / abort --------------------------------------------------------
    async def _resume(self, deadline_s: float | None = None) -> ResumeResult:
        """Resume (or abort) the open checkpoint; never raises for participants."""
        entry = self.open
        start = time.monotonic()
        if entry is None:
            return ResumeResult(checkpoint_id=None, seconds=0.0)
        failures = await self.resume_everyone(entry.checkpoint_id, deadline_s)
        return ResumeResult(
            checkpoint_id=entry.checkpoint_id, seconds=time.monotonic() - start, failures=failures
        )

    async def resume_everyone(
        self, cid: str, deadline_s: float | None = None, *, abort: bool = False
    ) -> dict[str, Any]:
        """Participants in reverse order (past failures), then paused controllers.

        `abort`: the checkpoint failed after an asynchronous commit captured
        records somewhere; the resume says so, and each participant discards
        its capture instead of writing what nothing will publish.  Only then:
        older participants (and NeMo Gym's) refuse a resume with the field.

        Nothing that raises here stops it: a group whose calls fail (or whose
        fan-out itself raises), a controller that cannot be resumed, a journal
        that cannot be written — each is logged and reported, and the next
        group is still resumed and the checkpoint still closed."""
        # Every member, not only those that prepared: a participant the prepare
        # never reached still records the ID, so a delayed prepare is refused.
        members = self._members()
        entry = self.open
        if entry is not None and entry.checkpoint_id == cid:
            entry.phase = "resuming"
            try:
                # A checkpoint recovers by resuming, whatever its journalled
                # phase; a restore's phase decides (undo or resume), so it is written.
                await self._record(entry, durable=entry.op == "restore")
            except Exception:
                log.exception("could not journal the resume of %s; resuming anyway", cid)
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
                out = await self._resume_directly(group, body, deadline_ts)
            failures.update({k: failure(e) for k, e in out.errors.items()})
        unpausing = self.clock.now()
        try:
            failures.update(await self.pauses.unpause(cid))
        except Exception as exc:
            log.exception("unpausing the controllers after %s raised", cid)
            failures["controllers"] = failure(CheckpointError(f"unpause raised: {exc!r}"[:500]))
        if self.pauses.targets:
            self.timeline.span(cid, COORDINATOR_ROW, "resume callers", unpausing, self.clock.now())
        await self._close()
        closing, self._to_close = self._to_close, []
        for host in closing:
            with contextlib.suppress(Exception):
                await host.aclose()
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
        self, group: Sequence[Member], body: Mapping[str, Any], deadline_ts: float
    ) -> Outcome:
        """One resume call per member, one at a time, without the fan-out."""
        out = Outcome()
        roster = self._roster()
        for m in group:
            host = roster.get(m.key)
            if host is None:
                continue
            timeout = max(deadline_ts - self.clock.now(), 0.0) + self.timeouts.reply_grace_s
            try:
                await asyncio.wait_for(host.call("resume", body), timeout)
            except Exception as exc:
                err = exc if isinstance(exc, CheckpointError) else CheckpointError(repr(exc))
                out.errors[m.key] = err
        return out

    async def _close(self) -> None:
        """No checkpoint open any more, in memory even if the journal fails."""
        try:
            self.renewer.stop()
        except Exception:
            log.exception("stopping the lease renewer raised")
        try:
            await self._record(None)
        except Exception:
            log.exception("could not clear the journal; the checkpoint is closed regardless")
            self.open = None
            self.frozen = {}
            self._prepare_restarts = set()

    @contextlib.asynccontextmanager
    async def _aborting(self, cid: str, *, abort: bool = False) -> AsyncIterator[None]:
        """Abort `cid` (resume everyone) if the body raises anything, then
        re-raise; `abort` as for `resume_everyone`."""
        try:
            yield
        except BaseException:
            await self._abort(cid, abort=abort)
            raise

    async def _abort(self, cid: str, *, abort: bool = False) -> None:
        await self.resume_everyone(cid, abort=abort)

    async def aclose(self) -> None:
        self.renewer.stop()
        await self.settle_journal()
        for host in list(self.hosts.values()):
            with contextlib.suppress(Exception):
                await host.aclose()


def _parent_of(checkpoint_dir: str) -> str:
    """Where `checkpoint_dir`'s `LATEST` lives (itself if it has no parent:
    its writer then fails, logged)."""
    try:
        return split_location(checkpoint_dir)[0]
    except CheckpointError:
        return checkpoint_dir
