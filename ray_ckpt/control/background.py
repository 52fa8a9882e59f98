"""The asynchronous commit's write: captured under the pause, stored after it.

A commit with `"durability": "async"` captures the records (a true copy a
later mutation of live state cannot reach, `capture`), answers `pending`,
and leaves the store write (encode, hash, write: pipelined as in the
synchronous commit) running here, outside the checkpoint's write
registry, so the resume that reopens admission does not stop it.  At most
one runs per participant: the next prepare waits for it.  When it ends, its
outcome (the manifest, or the typed error) is kept for the last few IDs, so
the coordinator's re-sent commit of the same ID is answered whether it comes
before or after the write finished, and whether or not the participant has
resumed since.

A plain resume (the coordinator's, once every member answered its commit)
starts the held write.  Both look alike to a participant, so the
coordinator's abort says so (`"abort": true` in the resume body: the
checkpoint will never be published); that discards it instead, unwritten, and a
re-sent commit of that ID is then refused `invalid_checkpoint_state`.  A
re-sent commit must name the directory and scope of the first (409
`checkpoint_conflict` otherwise, as in the synchronous commit).

A crash before the write is durable publishes nothing: the store creates
the manifest last, so the directory stays incomplete and the previous
checkpoint stays the restorable one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray_ckpt.control.commit import CommitScope, Write
from ray_ckpt.control.wire import CommitRequest, to_builtins
from ray_ckpt.errors import (
    CheckpointConflict,
    CheckpointError,
    DeadlineExceeded,
    InvalidCheckpointState,
)

OUTCOMES_KEPT = 8


@dataclass
class Pending:
    checkpoint_id: str
    write: Write
    begin: Callable[[], asyncio.Task[Any]]  # starts the store write
    task: asyncio.Task[Any] | None = None


class BackgroundWrites:
    def __init__(self) -> None:
        self.current: Pending | None = None
        # checkpoint ID -> the final commit reply, or the write's error
        self._outcomes: OrderedDict[str, dict[str, Any] | CheckpointError] = OrderedDict()
        self._replies: dict[str, dict[str, Any]] = {}  # the pending reply, until it ends
        # checkpoint ID -> the (directory, scope) its commit named, kept as
        # long as its outcome: a re-sent commit must name the same ones.
        self._targets: dict[str, tuple[str, CommitScope]] = {}

    def knows(self, checkpoint_id: str) -> bool:
        """This ID's commit was asynchronous (its write runs or has ended)."""
        running = self.current is not None and self.current.checkpoint_id == checkpoint_id
        return running or checkpoint_id in self._outcomes

    def check_same(self, req: CommitRequest, scope: CommitScope) -> None:
        """A re-sent commit of a known ID must name its directory and scope
        (`CheckpointConflict` otherwise, as `Write.check_same`): its answer is
        that write's manifest, which is not the directory asked for."""
        target = self._targets.get(req.checkpoint_id)
        if target is not None and target != (req.checkpoint_dir, scope):
            raise CheckpointConflict(
                f"commit of {req.checkpoint_id} already runs with another directory or scope"
            )

    def busy(self) -> str | None:
        """The ID whose write is due or still runs, if any."""
        current = self.current
        if current is not None and (current.task is None or not current.task.done()):
            return current.checkpoint_id
        return None

    def adopt(self, pending: Pending, reply: dict[str, Any]) -> None:
        """Hold `pending`'s write until `release`; `reply` (with the manifest
        added) answers every re-sent commit of its ID once it is durable."""
        self.current = pending
        self._replies[pending.checkpoint_id] = reply
        self._targets[pending.checkpoint_id] = (pending.write.checkpoint_dir, pending.write.scope)

    def release(self, checkpoint_id: str | None = None) -> asyncio.Task[Any] | None:
        """Start the held write (of `checkpoint_id`, or whichever is held).

        The write starts once the participant resumed (or when its commit is
        sent again), not when the capture ends: on a machine of few cores the
        other participants are still capturing under the same pause, and a
        write competing with them for the CPU would lengthen it."""
        current = self.current
        if current is None or (
            checkpoint_id is not None and current.checkpoint_id != checkpoint_id
        ):
            return None
        if current.task is None:
            task = current.task = current.begin()
            task.add_done_callback(lambda _t: self._settle(current))
        return current.task

    def _settle(self, pending: Pending) -> None:
        """Record a finished write's outcome (idempotent)."""
        cid, task = pending.checkpoint_id, pending.task
        if task is None or cid in self._outcomes or not task.done():
            return
        outcome: dict[str, Any] | CheckpointError
        if task.cancelled():
            outcome = InvalidCheckpointState(
                f"the write of {cid} was stopped before it was durable"
            )
        elif (exc := task.exception()) is not None:
            outcome = (
                exc
                if isinstance(exc, CheckpointError)
                else InvalidCheckpointState(f"the write of {cid} failed: {exc!r}"[:500])
            )
        else:
            pending.write.manifest = task.result()
            outcome = {
                **self._replies.pop(cid, {}),
                "manifest": to_builtins(task.result()),
                "captured_bytes": pending.write.captured_bytes,
                "spans": pending.write.span_dicts(),  # the write's own slice now included
            }
            outcome.pop("pending", None)
        self._record(cid, outcome)

    def _record(self, cid: str, outcome: dict[str, Any] | CheckpointError) -> None:
        self._replies.pop(cid, None)
        self._outcomes[cid] = outcome
        while len(self._outcomes) > OUTCOMES_KEPT:
            gone, _ = self._outcomes.popitem(last=False)
            self._targets.pop(gone, None)

    async def discard(self, checkpoint_id: str) -> None:
        """`checkpoint_id` was aborted: its held write is dropped, never
        written (the captured copies are freed with it); one a re-sent commit
        already started is stopped (the store publishes nothing once stopped,
        unless it was publishing).  A re-sent commit of the ID then answers
        `invalid_checkpoint_state`."""
        current = self.current
        if current is None or current.checkpoint_id != checkpoint_id:
            return
        if current.task is None:
            self.current = None
            self._record(
                checkpoint_id,
                InvalidCheckpointState(
                    f"checkpoint {checkpoint_id} was aborted; its captured write was discarded"
                ),
            )
            return
        # Started already: stop it; `_settle` records how it ended, and the
        # next prepare still waits for it to end.
        await current.write.halt()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) for the write in flight; True once none runs."""
        current = self.current
        if current is None:
            return True
        task = self.release(current.checkpoint_id)
        if task is None or task.done():
            return True
        await asyncio.wait({task}, timeout=max(timeout_s, 0.0))
        return task.done()

    async def outcome(self, checkpoint_id: str, timeout_s: float) -> dict[str, Any]:
        """The final reply of `checkpoint_id`'s write, waiting for it at most
        `timeout_s` (the write itself is never stopped by this wait); raises
        the write's error, or `DeadlineExceeded` if it is still running."""
        current = self.current
        if current is not None and current.checkpoint_id == checkpoint_id:
            if not await self.wait_idle(timeout_s):
                raise DeadlineExceeded(
                    f"the write of {checkpoint_id} is not durable yet; commit again to wait more"
                )
            self._settle(current)
        found = self._outcomes.get(checkpoint_id)
        if found is None:
            raise InvalidCheckpointState(f"no asynchronous write of {checkpoint_id} is known")
        if isinstance(found, CheckpointError):
            raise found
        return dict(found)

    def status(self) -> dict[str, Any] | None:
        """The write in flight, for `status` (None when none runs);
        `captured_bytes` is None until the write has measured the copy."""
        busy = self.busy()
        if busy is None or self.current is None:
            return None
        return {"checkpoint_id": busy, "captured_bytes": self.current.write.captured_bytes}

    async def aclose(self) -> None:
        """Stop the write in flight (a host that stops publishes nothing half-done)."""
        current = self.current
        if current is not None and current.task is not None and not current.task.done():
            await current.write.halt()
            with contextlib.suppress(BaseException):
                await current.task
        # A write never started is simply dropped: nothing of it was stored.
