"""Commit and restore: the two operations whose work outlives the call.

Both start long work once under the controller's lock (the store write of
the exported records; the install of the read ones), shield it, and await it
within the call's deadline: a missed deadline or a cancelled call fails the
call, not the work.  A retry with the same checkpoint ID awaits (or, after a
failure, restarts) that same work instead of doing it again, and the reply
is cached only once all of it, release steps included, is done.  That shared
shape is why these two orders of steps live together, apart from the phases
and the lease (`controller.py`); each step's work is in `commit` and
`restore`.  The caller is the `ParticipantController`; these read its state
at call time.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ray_ckpt.control.background import Pending
from ray_ckpt.control.commit import Write, exported_keys
from ray_ckpt.control.phase_machine import Event, Phase
from ray_ckpt.control.restore import restore_reply
from ray_ckpt.control.timing import within
from ray_ckpt.control.wire import CommitRequest, RestoreRequest
from ray_ckpt.errors import CheckpointConflict, InvalidCheckpointState, InvalidRequest
from ray_ckpt.identity import EpisodeId

if TYPE_CHECKING:
    from ray_ckpt.control.controller import ParticipantController


async def commit(c: ParticipantController, req: CommitRequest) -> dict[str, Any]:
    cid = req.checkpoint_id
    scope = tuple(req.episode_ids) if req.episode_ids is not None else None
    if c._background.knows(cid):
        # The commit of an asynchronous checkpoint, re-sent: wait for its write
        # (never stopping it), whether this participant has resumed since or not.
        # Only the same commit: one naming another directory or scope is
        # refused, as the synchronous path refuses it (`Write.check_same`).
        c._background.check_same(req, scope)
        return await c._background.outcome(cid, req.remaining(c.clock.now()))
    if req.durability == "async":
        return await _commit_async(c, req, scope)
    async with c._lock:
        write = c._writes.get(cid)
        if write is not None:
            write.check_same(req, scope)
        # Durable but not answered: a release step failed; a retry finishes it.
        releasing = write is not None and write.manifest is not None
        cached = c.state.admit("commit", cid, unfinished=releasing)
        if cached is not None:
            return dict(cached)
        # Refusals first (a passed deadline, an export the participant
        # refuses: no scope where it needs one, a restart-only episode in
        # it): a refused commit changes nothing, the lease included.
        req.remaining(c.clock.now())
        if write is None:
            write = await c._commits.export(req, scope)
            c._writes[cid] = write
        # Accepted: the lease now covers this call's deadline.
        c._renew(req)
        if releasing:
            return await _finish_commit(c, req, scope, write)
        # First try, or a retry after the store failed: store the same records again.
        task = c._commits.start(write, req)
    # The write is shielded: a missed deadline fails this call, not the write.
    manifest = await within(c.clock, req, "commit write", asyncio.shield(task))
    async with c._lock:
        if c.state.checkpoint_id != cid or c._writes.get(cid) is not write:
            cached = c.state.results.get((cid, "commit"))
            if cached is not None:
                return dict(cached)
            raise InvalidCheckpointState(f"commit of {cid} was stopped by a resume")
        if c.state.phase is Phase.PREPARED:
            c.state.fire(Event.COMMIT)
            write.manifest = manifest
        cached = c.state.results.get((cid, "commit"))
        if cached is not None:
            # A concurrent retry of this commit finished it first.
            return dict(cached)
        return await _finish_commit(c, req, scope, write)


async def _commit_async(
    c: ParticipantController, req: CommitRequest, scope: tuple[EpisodeId, ...] | None
) -> dict[str, Any]:
    """Capture, answer `pending`, and leave the write to `c._background`."""
    cid = req.checkpoint_id
    if req.stop:
        raise InvalidRequest(
            "stop needs durability sync: a participant that stops frees its state once "
            "it is durable, and an asynchronous commit answers before that"
        )
    async with c._lock:
        cached = c.state.admit("commit", cid)
        if cached is not None:
            return dict(cached)
        req.remaining(c.clock.now())
        busy = c._background.busy()
        if busy is not None:  # the prepare waited for it; a commit without one did not
            raise CheckpointConflict(f"the write of {busy} still runs; prepare waits for it")
        write = await c._commits.export(req, scope, capture=True)
        # Accepted only once captured: every refusal above changes nothing,
        # the lease included.
        c._renew(req)
        if scope is not None:
            # The capture holds its own copy: freeing restored state the
            # scope leaves out cannot change what is written.
            await within(c.clock, req, "release unscoped", c.participant.delete_restored(scope))
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
        # Started at the resume (`BackgroundWrites.release`).
        c._background.adopt(Pending(cid, write, lambda: c._commits.start(write, req)), reply)
        c.state.fire(Event.COMMIT)
        c.state.cache("commit", cid, reply)
        return dict(reply)


async def _finish_commit(
    c: ParticipantController,
    req: CommitRequest,
    scope: tuple[EpisodeId, ...] | None,
    write: Write,
) -> dict[str, Any]:
    """The release steps, then the reply, cached only once all of it is done."""
    reply = await c._commits.finish(req, scope, write)
    c.state.cache("commit", req.checkpoint_id, reply)
    return reply


async def restore(c: ParticipantController, req: RestoreRequest) -> dict[str, Any]:
    cid = req.checkpoint_id
    async with c._lock:
        install = c._restores.pending(cid)
        cached = c.state.admit("restore", cid, unfinished=install is not None)
        if cached is not None:
            return dict(cached)
        if install is not None:
            install.check_same(req)
        else:
            manifest, records = await c._restores.read(req)
            await c._apply(c.state.fire(Event.RESTORE, cid))
            install = c._restores.begin(req, manifest, records)
        # The lease runs from the restore's start: if the install outlives
        # this call and the coordinator goes away, the lease still resumes.
        c._renew(req)
        try:
            # Shielded: a missed deadline or a cancelled call (ray.cancel
            # of the coordinator's fan-out) ends this call, not the
            # install; the phase stays restored with admission closed
            # until the install ends and a retry, resume or lapse decides.
            installed = await within(c.clock, req, "install", asyncio.shield(install.task))
        except BaseException:
            if not install.failed():
                raise
            # The install itself raised: free what it left, reopen, and
            # answer with a typed error (the ID is not consumed).
            error = c._restores.failure(install)
            cause = None if install.task.cancelled() else install.task.exception()
            await c._restores.settle()
            await c._apply(c.state.fire(Event.RESTORE_FAILED))
            raise error from cause
        install.answered = True
        reply = restore_reply(install.manifest, installed)
        c.state.cache("restore", cid, reply)
        return reply
