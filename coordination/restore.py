"""Restore from a checkpoint, all or nothing, and its undo.

`restore` checks the Gym manifest lists exactly the registered participants
(no more, no fewer) — or, when the caller allows a directory without one
(NeMo Gym's controller writes none), that the participant manifests there
do — asks them all to install the given episodes, and on any failure (or
any exception of ours) runs
`undo_restore`: retire the next attempts everywhere, then resume everyone.
`recover` runs the same undo for a restore a previous coordinator left open.

Both work on a `PhaseDriver` the caller already holds the lock of; they use
its journal and group calls directly, as its own phases do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from coordination.calls import coordination_failed, episode_body, new_id
from coordination.fanout import failure
from coordination.hosts import Host
from coordination.journal import JournalEntry
from coordination.manifests import ManifestReader
from coordination.order import restore_groups, retire_groups
from coordination.phase_driver import PhaseDriver
from coordination.replies import int_or_none, string_list
from coordination.results import RestoreResult
from ray_ckpt.errors import (
    CheckpointConflict,
    CheckpointError,
    CoordinationFailed,
    InvalidCheckpointState,
    InvalidRequest,
    ParticipantNotFresh,
)
from ray_ckpt.identity import EpisodeId

log = logging.getLogger(__name__)


async def restore(
    driver: PhaseDriver,
    read_manifest: ManifestReader,
    checkpoint_dir: str,
    episodes: Sequence[EpisodeId],
    *,
    resume: bool,
    deadline_s: float | None,
) -> RestoreResult:
    """Every participant restores, or none keeps what it installed (lock held)."""
    if driver.open is not None:
        raise CheckpointConflict(f"checkpoint {driver.open.checkpoint_id} is open")
    # Taken before the manifest read (an await): whoever registers meanwhile
    # is not part of this restore.
    roster = dict(driver.hosts)
    if not roster:
        raise InvalidRequest("no participants are registered")
    start = time.monotonic()
    try:
        source_id, listed = await asyncio.to_thread(read_manifest, checkpoint_dir)
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
    # refuses the restore, and the undo of a refused restore retires the next
    # attempts of the episodes named, which on a running Gym are its own
    # rollouts in flight.  So a live fleet is refused here, as it was.
    stale = await not_fresh(roster, driver.timeouts.status_s)
    if stale:
        raise ParticipantNotFresh(
            f"restore from {checkpoint_dir} refused, nothing changed: "
            + "; ".join(f"{k} {why}" for k, why in sorted(stale.items()))
            + ". A restore installs into fresh processes only: restore into a newly "
            "started Gym"
        )
    driver.freeze(roster)
    members = [h.member for h in roster.values()]
    cid = new_id("restore")
    deadline_s = driver.timeouts.restore_s if deadline_s is None else deadline_s
    deadline_ts = driver.clock.now() + deadline_s
    keys = [e.capture_key for e in episodes]
    body = {
        "checkpoint_id": cid,
        "deadline_ts": deadline_ts,
        "checkpoint_dir": checkpoint_dir,
        "episode_ids": [episode_body(e) for e in episodes],
    }
    try:
        await driver._record(
            JournalEntry(
                checkpoint_id=cid,
                phase="restoring",
                op="restore",
                checkpoint_dir=checkpoint_dir,
                episode_ids=keys,
            )
        )
        out = await driver._group(restore_groups(members)[0], "restore", body, deadline_ts)
        if out.errors:
            raise coordination_failed(
                "restore", cid, {k: failure(e) for k, e in out.errors.items()}
            )
        entry = driver.open
        assert entry is not None
        entry.phase = "restored"
        await driver._record(entry)
    except BaseException:
        # Whatever raised (a participant, or a bug of ours): nobody keeps what
        # it installed, everyone is resumed.
        await undo_restore(driver, cid, episodes, deadline_ts)
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
    resume_failures = await driver.resume_everyone(cid) if resume else {}
    await fail_if_state_lost(driver, cid, episodes, resume_failures)
    return RestoreResult(
        checkpoint_id=cid,
        source_checkpoint_id=source_id,
        checkpoint_dir=checkpoint_dir,
        total_s=time.monotonic() - start,
        timings=out.timings,
        restored=restored,
        resumed=resume,
        continued=[e.capture_key for e in episodes if e.next().capture_key in installed],
        restart=[e.capture_key for e in episodes if e.next().capture_key not in installed],
        resume_failures=resume_failures,
    )


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


async def fail_if_state_lost(
    driver: PhaseDriver,
    cid: str,
    episodes: Sequence[EpisodeId],
    resume_failures: Mapping[str, Mapping[str, Any]],
) -> None:
    """A restore's resume that a participant refused because it lost installed
    state since the install (`restored_state_lost`: a worker died) fails the
    restore whole: the next attempts are retired everywhere (none continues,
    so none can start from nothing) and `CoordinationFailed` names the loss.
    The resume may be the restore's own or a later `resume()` of a restore
    left open (`resume=False`)."""
    lost = {k: f for k, f in resume_failures.items() if f.get("code") == "restored_state_lost"}
    if lost:
        await undo_restore(driver, cid, episodes, driver.clock.now())
        raise coordination_failed("restore", cid, {k: dict(f) for k, f in lost.items()})


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


async def undo_restore(
    driver: PhaseDriver, cid: str, episodes: Sequence[EpisodeId], deadline_ts: float
) -> None:
    """Retire the next attempts, then resume everyone; continue past failures.

    Retired everywhere, not only where the install finished: a restore that
    timed out may still install, and the same mark everywhere tells the
    controller one attempt number to start those rollouts over with.
    """
    cleanup_ts = max(deadline_ts, driver.clock.now() + driver.timeouts.cleanup_min_s)
    if episodes:
        body = {
            "checkpoint_id": cid,
            "deadline_ts": cleanup_ts,
            "episode_ids": [episode_body(e.next()) for e in episodes],
        }
        for group in retire_groups(driver._members()):
            try:
                out = await driver._group(group, "retire", body, cleanup_ts)
            except Exception:
                # Retired or not, everyone must still be resumed below.
                log.exception("cleanup retire of %s at %s raised", cid, group)
                continue
            for key, err in out.errors.items():
                log.warning("cleanup retire of %s at %s failed: %s", cid, key, err)
    await driver.resume_everyone(cid)
