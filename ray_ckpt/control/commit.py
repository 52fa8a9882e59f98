"""The write-once commit: one checkpoint's export and its store write.

A commit exports the participant's episodes once and stores those records;
a retried commit (same directory and scope) awaits, or restarts after a
failure, that same write instead of exporting again.  The engine keeps
the phase machine, the lock, the write registry and the commit's order of
steps (the release steps after the write included); `Commits` does the work
of each step on the participant and the store, and the `Write` record carries
one write's lifecycle (start, retry, stop, close).

`Commits` is given the participant once; the store and the clock at each
call, because they are the engine's replaceable attributes (a host or a
test swaps the store), and a write must use the one in place when it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ray_ckpt.clock import Clock
from ray_ckpt.control.capture import Audited, capture
from ray_ckpt.control.phase_machine import Phase
from ray_ckpt.control.progress import progress_of
from ray_ckpt.control.protocol import Participant
from ray_ckpt.control.timing import within
from ray_ckpt.control.wire import CommitRequest, to_builtins
from ray_ckpt.errors import (
    CheckpointConflict,
    DeadlineExceeded,
    InvalidPhase,
    RestartInScope,
)
from ray_ckpt.identity import EpisodeId, is_result_key
from ray_ckpt.reports import MAX_REPORTED_BLOCKERS
from ray_ckpt.storage.records.record import Record, check_json
from ray_ckpt.storage.seam import RecordStore, StopHandle

# The engine's logger, not this module's: moving the code out of the
# engine must not move its warnings away from the operators' log filters.
log = logging.getLogger("ray_ckpt.control.engine")

CommitScope = tuple[EpisodeId, ...] | None
# The capture gives the loop a turn this often (seconds).
_SLICE_S = 0.02


@dataclass
class Write:
    """One checkpoint's export, made once; a retried commit awaits the same write."""

    checkpoint_dir: str
    scope: CommitScope
    records: list[Record]
    stop: StopHandle
    # An asynchronous commit's capture: its copies are audited (and their
    # size measured) by the write as it reads them, after the resume
    # (`capture.Audited`).
    captured: bool = False
    audited: Audited | None = None
    task: asyncio.Task[Any] | None = None
    # Set once the records are durable (the phase is then committed); the
    # release steps after it may still fail and be retried with the same ID.
    manifest: Any = None
    released: bool = False
    parked: bool = False
    # What this write did when, for the coordinator's timeline: (name, start,
    # end) in the engine's clock (epoch seconds), answered with the commit.
    spans: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def captured_bytes(self) -> int | None:
        """The captured copies' bytes, once the write has read all of them."""
        return self.audited.size if self.audited is not None else None

    def span_dicts(self) -> list[dict[str, Any]]:
        return [{"name": n, "start": a, "end": b} for n, a, b in self.spans]

    def check_same(self, req: CommitRequest, scope: CommitScope) -> None:
        """Another commit of the checkpoint must name this write's directory and scope."""
        if (self.checkpoint_dir, self.scope) != (req.checkpoint_dir, scope):
            raise CheckpointConflict(
                f"commit of {req.checkpoint_id} already runs with another directory or scope"
            )

    async def halt(self) -> None:
        """Stop the write; waits only for a publication already under way.

        That wait may be an fsync, so it runs on a thread; with no write
        running (none started, or done: every resume after a commit) nothing
        holds the stop's lock, and the thread hop would only add latency."""
        if self.task is None or self.task.done():
            self.stop.stop()
        else:
            await asyncio.to_thread(self.stop.stop)

    async def close(self) -> None:
        """Stop the write and wait for its task, whatever its outcome."""
        await self.halt()
        if self.task is not None:
            with contextlib.suppress(BaseException):
                await self.task


class Commits:
    """The commit's work on the participant and the store (the caller holds the lock)."""

    def __init__(self, participant: Participant, *, instance: str) -> None:
        self._participant = participant
        self._kind = participant.kind
        self._instance = instance

    async def export(
        self,
        req: CommitRequest,
        scope: CommitScope,
        store: RecordStore,
        clock: Clock,
        *,
        capture: bool = False,
    ) -> Write:
        """From a still-ready participant, export the scope (restart-only
        episodes refused) into the checkpoint's one `Write`.  `capture`: a
        true copy of each state (`capture.copy_state`) that the live state's
        later changes cannot reach (the asynchronous commit writes after the
        resume)."""
        participant = self._participant
        if not participant.ready():
            raise InvalidPhase(f"{self._kind}/{self._instance} is no longer ready")
        if scope is not None:
            restarts = set(participant.report(MAX_REPORTED_BLOCKERS).restarts)
            named = sorted(e.capture_key for e in scope if e.capture_key in restarts)
            if named:
                raise RestartInScope(f"commit scope names restart-only episodes {named}")
        started = clock.now()
        records = await within(clock, req, "export", participant.export(scope))
        if scope is not None:
            wanted = {e.capture_key for e in scope}
            # Held results (completion receipts) are never work in a scope:
            # they go into every checkpoint while unacknowledged.
            records = [r for r in records if r.key in wanted or is_result_key(r.key)]
        if capture:
            records = await captured(records)
        else:
            for record in records:
                check_json(record.state, episode=record.key)
        write = Write(
            req.checkpoint_dir,
            scope,
            records,
            store.new_stop(),
            captured=capture,
            audited=Audited(records) if capture else None,
        )
        write.spans.append(("capture", started, clock.now()))
        return write

    def start(
        self, write: Write, req: CommitRequest, store: RecordStore, clock: Clock
    ) -> asyncio.Task[Any]:
        """The store write's task: started on the first try, and started again
        (with the same records) when a retry finds the previous one failed."""
        task = write.task
        failed = (
            task is not None and task.done() and (task.cancelled() or task.exception() is not None)
        )
        if task is None or failed:
            started = clock.now()
            task = write.task = asyncio.ensure_future(
                asyncio.to_thread(
                    store.write,
                    req.checkpoint_dir,
                    kind=self._kind,
                    instance=self._instance,
                    checkpoint_id=req.checkpoint_id,
                    # A capture's copies are audited as the store reads them.
                    records=write.audited if write.audited is not None else write.records,
                    stop=write.stop,
                )
            )
            # Encode, hash, write, fsync and publish: the store does them as one.
            task.add_done_callback(lambda _t: write.spans.append(("write", started, clock.now())))
        return task

    async def park_exported(self, req: CommitRequest, records: list[Record], clock: Clock) -> None:
        """The engine stops instead of resuming: once the write is durable,
        free external compute the exported episodes hold (best effort: a
        failure only costs resources, never the checkpoint, so it is logged;
        only the deadline fails the call, for a retry to park again)."""
        park = getattr(self._participant, "park_exported", None)
        if park is None:
            return
        try:
            await within(clock, req, "park exported", park(records))
        except Exception as exc:
            if isinstance(exc, DeadlineExceeded):
                raise
            log.warning("%s/%s: park_exported failed", self._kind, self._instance, exc_info=True)


async def captured(records: list[Record]) -> list[Record]:
    """A true copy of each record's state (`capture.capture`).

    On the event loop, not a thread: a copy walks the state in Python, and no
    coroutine of the participant's can change a state halfway through its
    copy.  Between states it yields every few milliseconds, so the loop still
    answers other calls; the participant is paused, so nothing changes the
    exported states then either (as when they were encoded on a thread)."""
    out: list[Record] = []
    loop = asyncio.get_running_loop()
    todo = iter(records)
    while True:
        # The copies make no cycles, but their many new containers set off
        # the collector's passes over every live state in the process: paused
        # for a slice, while the loop does not run (measured: one host's share
        # at 350 KB copies in 41 ms so, 66 ms with the collector on).
        with _collector_paused():
            until = loop.time() + _SLICE_S
            for r in todo:
                out.append(capture(r))
                if loop.time() >= until:
                    break
            else:
                return out
        await asyncio.sleep(0)


def commit_reply(write: Write) -> dict[str, Any]:
    """A durable synchronous commit's reply."""
    return {
        "phase": Phase.COMMITTED.value,
        "manifest": to_builtins(write.manifest),
        **exported_keys(write.records),
        "spans": write.span_dicts(),
    }


def exported_keys(records: list[Record]) -> dict[str, Any]:
    """A commit reply's `episode_ids` (capture keys) and, apart, how many
    finished results it carries (completion receipts; only when some)."""
    episodes = sorted(r.key for r in records if not is_result_key(r.key))
    results = len(records) - len(episodes)
    # How far each had got, where its record says (`progress`): the restart
    # bias of a restore from this checkpoint is counted from it.
    progress = progress_of(records)
    return {
        "episode_ids": episodes,
        **({"results": results} if results else {}),
        **({"progress": progress} if progress else {}),
    }


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
