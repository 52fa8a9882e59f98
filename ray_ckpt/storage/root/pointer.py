"""The `LATEST` pointer of a root: which checkpoint under it is the latest.

After a checkpoint's Gym manifest (its commit point) the coordinator replaces
``<parent>/LATEST`` atomically (`Blobs.replace`: readers see the old pointer
or the new one) to name it.  The pointer is a hint that makes `latest` cheap
to answer and stable while checkpoints are written; it is never the commit
point, so an unreadable or stale one is ignored (`catalog.pick_latest` falls
back to the newest complete checkpoint by time).

The pointer of a checkpoint goes in its location's parent
(`locations.split_location`).
"""

from __future__ import annotations

import logging

import msgspec

from ray_ckpt.storage.blobstore.blobs import BlobMissing, Blobs
from ray_ckpt.storage.blobstore.locations import open_location, split_location

log = logging.getLogger(__name__)

LATEST_KEY = "LATEST"


class LatestPointer(msgspec.Struct, frozen=True):
    """What `LATEST` holds: the checkpoint's name under the root and its ID
    (so a name reused for another checkpoint is not mistaken for it)."""

    name: str
    checkpoint_id: str


# --- LATEST -------------------------------------------------------------------


def write_latest(blobs: Blobs, name: str, checkpoint_id: str) -> None:
    """Point `LATEST` at `name` (atomic: readers see the old or the new one)."""
    blobs.replace(LATEST_KEY, msgspec.json.encode(LatestPointer(name, checkpoint_id)) + b"\n")


def write_latest_for(checkpoint_dir: str, checkpoint_id: str) -> None:
    """After the Gym manifest of `checkpoint_dir`: its parent's `LATEST` names it."""
    parent, name = split_location(checkpoint_dir)
    write_latest(open_location(parent), name, checkpoint_id)


def read_latest(blobs: Blobs) -> LatestPointer | None:
    """The pointer, or None if absent or unreadable (it is only a hint)."""
    try:
        data = blobs.read(LATEST_KEY)
    except BlobMissing:
        return None
    try:
        return msgspec.json.decode(data, type=LatestPointer)
    except msgspec.DecodeError:
        log.warning("%s/%s is unreadable; ignored", blobs.url, LATEST_KEY)
        return None
