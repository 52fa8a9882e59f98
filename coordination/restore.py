"""Restore from a checkpoint, all or nothing, and its undo.

`restore` checks the Gym manifest lists every registered participant, asks
them all to install the given episodes, and on any failure runs
`undo_restore`: retire the next attempts everywhere, then resume everyone.
`recover` runs the same undo for a restore a previous coordinator left open.

Both work on a `PhaseDriver` the caller already holds the lock of; they use
its journal and group calls directly, as its own phases do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from coordination.calls import coordination_failed, episode_body, new_id
from coordination.fanout import failure
from coordination.journal import JournalEntry
from coordination.manifests import ManifestReader
from coordination.order import restore_groups, retire_groups
from coordination.phase_driver import PhaseDriver
from coordination.results import RestoreResult
from ray_ckpt.errors import (
    CheckpointConflict,
    CheckpointError,
    CoordinationFailed,
    InvalidCheckpointState,
    InvalidRequest,
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
    members = driver._members()
    if not members:
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
    # Checked before touching anyone: a participant the checkpoint does
    # not list would start empty while the others continue.
    missing = sorted(m.key for m in members if (m.kind, m.name) not in listed)
    if missing:
        err = InvalidCheckpointState(f"not listed in the Gym manifest of {checkpoint_dir}")
        raise coordination_failed("restore", source_id or "?", {k: failure(err) for k in missing})
    cid = new_id("restore")
    deadline_s = driver.timeouts.restore_s if deadline_s is None else deadline_s
    deadline_ts = driver.clock.now() + deadline_s
    keys = [e.capture_key for e in episodes]
    driver._record(
        JournalEntry(
            checkpoint_id=cid,
            phase="restoring",
            op="restore",
            checkpoint_dir=checkpoint_dir,
            episode_ids=keys,
        )
    )
    body = {
        "checkpoint_id": cid,
        "deadline_ts": deadline_ts,
        "checkpoint_dir": checkpoint_dir,
        "episode_ids": [episode_body(e) for e in episodes],
    }
    out = await driver._group(restore_groups(members)[0], "restore", body, deadline_ts)
    if out.errors:
        await undo_restore(driver, cid, episodes, deadline_ts)
        raise coordination_failed("restore", cid, {k: failure(e) for k, e in out.errors.items()})
    entry = driver.open
    assert entry is not None
    entry.phase = "restored"
    driver._record(entry)
    if resume:
        await driver.resume_everyone(cid)
    return RestoreResult(
        checkpoint_id=cid,
        source_checkpoint_id=source_id,
        checkpoint_dir=checkpoint_dir,
        total_s=time.monotonic() - start,
        timings=out.timings,
        restored={k: list(r.get("restored", [])) for k, r in out.replies.items()},
        resumed=resume,
    )


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
            out = await driver._group(group, "retire", body, cleanup_ts)
            for key, err in out.errors.items():
                log.warning("cleanup retire of %s at %s failed: %s", cid, key, err)
    await driver.resume_everyone(cid)
