"""Prepare and commit of a checkpoint across the fleet, and what the commit answers.

`prepare` opens a checkpoint (freezing its members, journalling, pausing the
prepare-time controllers) and asks each group to close admission and reach
its boundaries; `commit` has every member write its records, then writes the
Gym manifest, the commit point of the whole checkpoint, last of all.

Both work on a `PhaseDriver` the caller already holds the lock of, as
`coordination.restore` does: the driver keeps membership, the journal, the
group calls and the failure path (`_aborting` resumes everyone), which every
operation shares; these two are the forward steps only a checkpoint takes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from coordination.calls import coordination_failed, episode_body, new_id
from coordination.fanout import Outcome, failure
from coordination.journal import JournalEntry
from coordination.order import commit_groups, prepare_groups
from coordination.replies import as_mapping, int_or_none, report_of, string_list
from coordination.results import CommitResult, PrepareResult
from coordination.timeline import COORDINATOR_ROW
from ray_ckpt.errors import (
    CheckpointConflict,
    CheckpointError,
    DeadlineExceeded,
    InvalidRequest,
    RestartInScope,
)
from ray_ckpt.identity import EpisodeId

if TYPE_CHECKING:
    from coordination.phase_driver import PhaseDriver

log = logging.getLogger(__name__)


def manifest_bytes(manifest: Any, listed: Any = None) -> int:
    """Bytes a participant wrote: its records object's size as the Gym
    manifest `listed` measured it (the writer's return), whichever shape the
    participant manifest has; else what the manifest says (ours carry
    `bytes`; NeMo Gym's do not, and say 0 then).

    NeMo Gym's manifests name their records file, digest and count, never a
    size: only the written object knows it, and the Gym manifest's writer
    has just read it (and checked it against `bytes` where there is one)."""
    from ray_ckpt.storage.gym_manifest import GymManifest

    m = as_mapping(manifest)
    kind, instance = m.get("kind"), m.get("instance")
    if isinstance(listed, GymManifest):
        for e in listed.participants:
            if e.kind == kind and e.instance == instance:
                return e.bytes
    return int_or_none(m.get("bytes")) or 0


async def prepare(driver: PhaseDriver, deadline_s: float | None = None) -> PrepareResult:
    """Open a checkpoint and prepare every member, group by group (lock held)."""
    if driver.open is not None:
        raise CheckpointConflict(
            f"checkpoint {driver.open.checkpoint_id} is open ({driver.open.phase}); resume it first"
        )
    if not driver.hosts:
        raise InvalidRequest("no participants are registered")
    start = time.monotonic()
    cid = new_id("ckpt")
    driver.note_opened(cid)  # its place in the order `LATEST` keeps
    deadline_s = driver.timeouts.prepare_s if deadline_s is None else deadline_s
    deadline_ts = driver.clock.now() + deadline_s
    driver.freeze(driver.hosts)
    members = [h.member for h in driver.frozen.values()]
    # From here on whatever raises (a participant's reply, a pause target, a
    # bug of ours, the journal) aborts: every member is resumed before the
    # error leaves, and nothing stays open.
    async with driver._aborting(cid):
        await driver._record(JournalEntry(checkpoint_id=cid, phase="preparing", op="checkpoint"))
        driver.renewer.start(cid)
        pausing = driver.clock.now()
        await driver.pauses.pause(cid, driver.pauses.prepare_roles(), deadline_s)
        if driver.pauses.targets:
            driver.timeline.span(cid, COORDINATOR_ROW, "pause callers", pausing, driver.clock.now())
        body = {"checkpoint_id": cid, "deadline_ts": deadline_ts}
        timings: dict[str, float] = {}
        restarts: dict[str, list[str]] = {}
        for group in prepare_groups(members):
            out = await driver._group(group, "prepare", body, deadline_ts)
            timings.update(out.timings)
            failures = {k: failure(e) for k, e in out.errors.items()}
            for key, reply in out.replies.items():
                report = report_of(reply)
                if string_list(report.get("restarts")):
                    restarts[key] = string_list(report.get("restarts"))
                if reply.get("phase") != "prepared":
                    err = DeadlineExceeded(
                        f"{key} is not prepared at the deadline (phase {reply.get('phase')})"
                    )
                    failures[key] = failure(err, report)
            if failures:
                raise coordination_failed("prepare", cid, failures)
        # In memory only: recovery aborts a "preparing" checkpoint as it would a
        # "prepared" one, so the write would add nothing but time to the pause.
        await driver._record(
            JournalEntry(checkpoint_id=cid, phase="prepared", op="checkpoint"), durable=False
        )
    driver._prepare_restarts = {k for keys in restarts.values() for k in keys}
    seconds = time.monotonic() - start
    log.info("prepare %s: %d participants in %.3fs", cid, len(timings), seconds)
    return PrepareResult(checkpoint_id=cid, seconds=seconds, timings=timings, restarts=restarts)


async def commit(
    driver: PhaseDriver,
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
    """Commit the prepared checkpoint everywhere, then the Gym manifest (lock held).

    Then the parent's LATEST pointer, unless `defer_latest`: a caller that
    resumes at once writes it alongside the resume (`driver._write_latest`),
    since the checkpoint is complete with its Gym manifest.

    `publish_by` (the clock's time): the latest the Gym manifest may start
    being written.  Past it the checkpoint fails whole (`DeadlineExceeded`,
    records left unpublished, everyone resumed), so a checkpoint bounded by
    a grace budget never becomes `latest` after the caller gave up on it."""
    entry = driver.open
    if entry is None or entry.op != "checkpoint" or entry.phase not in ("prepared", "committing"):
        raise CheckpointConflict("no prepared checkpoint is open: prepare first")
    if strict and stop:
        # A stopping commit frees what its exported episodes hold before the
        # strict check can refuse it; the refused checkpoint resumes them.
        raise InvalidRequest("strict and stop cannot be combined")
    cid = entry.checkpoint_id
    start = time.monotonic()
    deadline_s = driver.timeouts.commit_s if deadline_s is None else deadline_s
    deadline_ts = driver.clock.now() + deadline_s
    if publish_by is not None:
        deadline_ts = min(deadline_ts, publish_by)
    async with driver._aborting(cid, abort=durability == "async"):
        # In memory only, as "prepared": recovery resumes everyone whichever
        # phase a checkpoint was left in, so a write would only lengthen the pause.
        await driver._record(
            JournalEntry(
                checkpoint_id=cid,
                phase="committing",
                op="checkpoint",
                checkpoint_dir=checkpoint_dir,
            ),
            durable=False,
        )
        body: dict[str, Any] = {
            "checkpoint_id": cid,
            "deadline_ts": deadline_ts,
            "checkpoint_dir": checkpoint_dir,
            "episode_ids": None if scope is None else [episode_body(e) for e in scope],
            "stop": stop,
        }
        if durability == "async":
            body["durability"] = "async"  # only then: older participants forbid the field
        barrier = driver.pauses.commit_roles()
        out = Outcome()
        try:
            await driver.pauses.pause(cid, barrier, deadline_s)
            for group in commit_groups(driver._members()):
                out.merge(await driver._group(group, "commit", body, deadline_ts))
        finally:
            await driver.pauses.unpause(cid, barrier)
        if out.errors:
            if strict and all(isinstance(e, RestartInScope) for e in out.errors.values()):
                # The same cause as the strict check below (an episode of the
                # scope would start over), refused by the participants
                # themselves (restart-only ones fail closed): the same error.
                refused = "; ".join(f"{k}: {e.detail}" for k, e in sorted(out.errors.items()))
                raise RestartInScope(f"commit of {cid} refused (strict): {refused}")
            raise coordination_failed("commit", cid, {k: failure(e) for k, e in out.errors.items()})
        exported = {k: string_list(r.get("episode_ids")) for k, r in out.replies.items()}
        continued, restart = split_continued(scope, exported, driver._prepare_restarts)
        if strict and restart:
            # Before the Gym manifest: the records written stay unpublished.
            raise RestartInScope(
                f"commit of {cid} refused (strict): no participant holds state for "
                f"{restart}; they would start over"
            )
        if durability == "async":
            # Captured, not yet durable: no Gym manifest until every write is
            # (`coordination.async_commit`, after the resume).
            return CommitResult(
                checkpoint_id=cid,
                checkpoint_dir=checkpoint_dir,
                seconds=time.monotonic() - start,
                manifest_s=0.0,
                timings=out.timings,
                # Unknown, not 0: nothing is written yet, and the copies are
                # measured by the writes after the resume (`DurableResult`
                # gives both sizes).
                bytes={k: None for k in out.replies},
                episode_ids=exported,
                continued=continued,
                restart=restart,
                pending=True,
            )
        manifests = [dict(as_mapping(r.get("manifest"))) for _, r in sorted(out.replies.items())]
        driver.learn_layout(out.replies)
        late = None if publish_by is None else driver.clock.now() - publish_by
        if late is not None and late > 0:
            late_err = DeadlineExceeded(
                f"checkpoint {cid} not ready to publish inside its overall deadline "
                f"({late:.2f}s late); its records stay unpublished"
            )
            raise coordination_failed("commit", cid, {"gym-manifest": failure(late_err)})
        m_start = time.monotonic()
        publishing = driver.clock.now()
        try:
            # Last of all: the Gym manifest is the commit point of the whole checkpoint.
            listed = await asyncio.to_thread(driver.manifest_writer, checkpoint_dir, cid, manifests)
            driver.timeline.span(cid, COORDINATOR_ROW, "publish", publishing, driver.clock.now())
        except Exception as exc:
            err = exc if isinstance(exc, CheckpointError) else CheckpointError(repr(exc))
            raise coordination_failed("commit", cid, {"gym-manifest": failure(err)}) from None
        if not defer_latest:
            await driver._write_latest(checkpoint_dir, cid)
        manifest_s = time.monotonic() - m_start
        await driver._record(
            JournalEntry(
                checkpoint_id=cid,
                phase="committed",
                op="checkpoint",
                checkpoint_dir=checkpoint_dir,
            ),
            durable=False,  # the Gym manifest is the durable record of this step
        )
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
    return CommitResult(
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
