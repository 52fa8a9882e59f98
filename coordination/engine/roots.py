"""The coordinator's storage glue: up-front location checks, `LATEST`, `latest`.

- Every location a call names is checked before anyone is paused
  (`writable`, `readable`): a relative path, an unknown scheme or a location
  that cannot be reached costs an `InvalidRequest` naming it, not a prepare
  and an abort.  The check runs where the coordinator runs; a participant on
  another node that still cannot reach it fails its commit, which aborts.
- After the Gym manifest (the commit point) the checkpoint's parent gets a
  `LATEST` naming it (`write_latest_quietly`, the core's default
  `latest_writer`): right after the manifest, or, for a checkpoint that
  resumes at once, beside the resume and before the call returns.
  `write_gym_manifest_and_latest` does both in one call (tools, tests).
- Before the pause, the participants' folders are created on a local root
  (`precreate_participant_dirs`), so no commit creates them inside it.
- Before anyone is paused, the checkpoint's directory is made ready for it
  (`ready_for_checkpoint`): one holding a complete checkpoint is refused,
  an aborted checkpoint's leftovers are cleared.
- `restore(root, latest=True)` resolves to the checkpoint `latest` picks, and
  a restore without episodes takes every episode the checkpoint lists.

Each blocking step runs in a thread: the coordinator's loop never waits on
storage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from coordination.engine.manifests import write_gym_manifest_from_replies
from ray_ckpt.errors import (
    CheckpointConflict,
    CheckpointError,
    InvalidCheckpointState,
    InvalidRequest,
)
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.blobstore import durable
from ray_ckpt.storage.blobstore.local_blobs import LocalBlobs
from ray_ckpt.storage.blobstore.locations import check_location, open_location, split_location
from ray_ckpt.storage.participant.participant_manifest import GYM, participant_dir
from ray_ckpt.storage.root.catalog import CheckpointEntry, latest_location, scan, scan_one
from ray_ckpt.storage.root.gym_manifest import has_gym_manifest, read_gym_manifest
from ray_ckpt.storage.root.pointer import write_latest_for
from ray_ckpt.storage.root.retention import DEFAULT_GRACE_S, GcPlan, collect

log = logging.getLogger(__name__)


def write_gym_manifest_and_latest(
    checkpoint_dir: str, checkpoint_id: str, manifests: list[dict[str, Any]]
) -> Any:
    """The Gym manifest, then `<parent>/LATEST` naming the checkpoint.

    The checkpoint is complete once the Gym manifest is written, so a `LATEST`
    that cannot be written is logged, never a failed checkpoint: `latest`
    then falls back to the newest complete checkpoint by time."""
    gym = write_gym_manifest_from_replies(checkpoint_dir, checkpoint_id, manifests)
    write_latest_quietly(checkpoint_dir, checkpoint_id)
    return gym


def precreate_participant_dirs(
    checkpoint_dir: str, participants: Iterable[tuple[str, str]]
) -> None:
    """Create `<dir>/gym/<kind>/<instance>/` for each (kind, instance), durably,
    with one fsync per parent folder, before the checkpoint pauses anyone:
    each participant then finds its folder there instead of creating it (and
    fsyncing three parents) inside the pause.  Only an optimisation: on an
    object store there are no folders, and a failure is logged, leaving the
    participants to create their own as before."""
    try:
        blobs = open_location(checkpoint_dir)
        if not isinstance(blobs, LocalBlobs):
            return
        durable.ensure_dirs(participant_dir(blobs.root, k, i) for k, i in participants)
    except (CheckpointError, OSError) as exc:
        log.warning("could not create the participant folders of %s: %s", checkpoint_dir, exc)


def ready_for_checkpoint(checkpoint_dir: str) -> None:
    """Make `checkpoint_dir` ready for a new checkpoint, before anyone is paused.

    A directory holding a complete checkpoint (its Gym manifest) is refused
    (`CheckpointConflict` naming it and the remedy): a checkpoint is never
    overwritten, and every participant's commit there would fail, after the
    whole Gym was paused for nothing.  What an aborted checkpoint left there
    (records and participant manifests under ``gym/``, no Gym manifest) is
    deleted: nothing was published, and nothing references it (an
    incremental base is always a complete checkpoint), while each manifest
    left would fail that participant's commit of a retry ("already holds a
    different commit") every time.  Only keys under ``gym/`` are touched:
    anything else in the directory is not a checkpoint's.

    The caller settles any asynchronous checkpoint first, so none is still
    writing into the directory."""
    blobs = open_location(checkpoint_dir)
    if has_gym_manifest(blobs):
        try:
            which = f"complete checkpoint {read_gym_manifest(blobs).checkpoint_id}"
        except CheckpointError:
            which = "a Gym manifest"
        raise CheckpointConflict(
            f"{checkpoint_dir} already holds {which}; a checkpoint is never overwritten: "
            "checkpoint into a new directory (or delete this one first)"
        )
    leftovers = [info.key for info in blobs.list(GYM)]
    if leftovers:
        log.warning(
            "%s holds %d objects of a checkpoint that never completed; deleting them",
            checkpoint_dir,
            len(leftovers),
        )
        blobs.delete(leftovers)


def write_latest_quietly(checkpoint_dir: str, checkpoint_id: str) -> None:
    """`<parent>/LATEST` naming a complete checkpoint; a failure is logged
    (the checkpoint is complete without it: `latest` falls back by time)."""
    try:
        write_latest_for(checkpoint_dir, checkpoint_id)
    except (CheckpointError, OSError) as exc:
        log.warning("checkpoint %s is complete; LATEST not updated: %s", checkpoint_dir, exc)


async def writable(location: str) -> None:
    """Refuse (`InvalidRequest` naming it) a location a checkpoint cannot be written to."""
    await asyncio.to_thread(check_location, location, for_write=True)


async def readable(location: str) -> None:
    await asyncio.to_thread(check_location, location, for_write=False)


async def restore_target(
    location: str, episode_ids: Sequence[EpisodeId] | None, *, latest: bool
) -> tuple[str, list[EpisodeId]]:
    """(checkpoint location, episodes) of a restore: `latest` reads `location`
    as a root; no episodes means every episode the checkpoint lists.

    A plain restore checks that the checkpoint's parent can be read: an
    unreachable location is refused here, while a checkpoint simply absent
    under a readable parent is the restore's own typed "missing Gym
    manifest" failure, as before."""
    if latest:
        await readable(location)
    else:
        parent = _parent_or_self(location)
        try:
            await readable(parent)
        except InvalidRequest as exc:
            if parent == location:
                raise
            raise InvalidRequest(f"checkpoint location {location!r}: {exc.detail}") from None
    return await asyncio.to_thread(_restore_target, location, episode_ids, latest)


def _parent_or_self(location: str) -> str:
    open_location(location)  # a relative path or an unknown scheme: refused as named
    try:
        return split_location(location)[0]
    except InvalidRequest:
        return location


def _restore_target(
    location: str, episode_ids: Sequence[EpisodeId] | None, latest: bool
) -> tuple[str, list[EpisodeId]]:
    if latest:
        where, picked = latest_location(location, open_location(location))
    elif episode_ids is not None:
        return location, list(episode_ids)
    else:
        parent, name = split_location(location)
        where, picked = location, scan_one(open_location(parent), name)
    if episode_ids is not None:
        return where, list(episode_ids)
    if not picked.entry.complete:
        raise InvalidCheckpointState(
            f"checkpoint {where} is not complete ({picked.problem}): name the episodes "
            "to restore it without a Gym manifest"
        )
    if picked.episode_keys is None:
        raise InvalidRequest(
            f"the participant manifests of {where} do not list their episodes: name them"
        )
    return where, [EpisodeId.from_capture_key(k) for k in picked.episode_keys]


async def retain(root: str, keep: int, grace_s: float = DEFAULT_GRACE_S) -> GcPlan:
    """Apply `keep_latest_k` under `root` (the periodic loop's, after a checkpoint)."""
    return await asyncio.to_thread(lambda: collect(open_location(root), keep, grace_s=grace_s))


def list_root(root: str) -> list[CheckpointEntry]:
    """`ray-ckpt list`: the checkpoints under `root`, oldest first."""
    return scan(check_location(root, for_write=False)).entries


def gc_root(root: str, keep: int, *, dry_run: bool, grace_s: float = DEFAULT_GRACE_S) -> GcPlan:
    """`ray-ckpt gc`: retention by hand."""
    blobs = check_location(root, for_write=False)
    return collect(blobs, keep, dry_run=dry_run, grace_s=grace_s)
