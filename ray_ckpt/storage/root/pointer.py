"""The `LATEST` pointer of a root, and the names of checkpoint locations.

After a checkpoint's Gym manifest (its commit point) the coordinator replaces
``<parent>/LATEST`` atomically (`Blobs.replace`: readers see the old pointer
or the new one) to name it.  The pointer is a hint that makes `latest` cheap
to answer and stable while checkpoints are written; it is never the commit
point, so an unreadable or stale one is ignored (`catalog.pick_latest` falls
back to the newest complete checkpoint by time).

A checkpoint location's parent and name are plain string operations on an
absolute path or a URI (`split_location`, `join_location`): the same for
``/ckpt/step-1``, ``file:///ckpt/step-1`` and ``s3://bucket/ckpt/step-1``.
"""

from __future__ import annotations

import logging

import msgspec

from ray_ckpt.errors import InvalidRequest
from ray_ckpt.storage.blobs import BlobMissing, Blobs

log = logging.getLogger(__name__)

LATEST_KEY = "LATEST"


class LatestPointer(msgspec.Struct, frozen=True):
    """What `LATEST` holds: the checkpoint's name under the root and its ID
    (so a name reused for another checkpoint is not mistaken for it)."""

    name: str
    checkpoint_id: str


# --- locations ----------------------------------------------------------------


def split_location(location: str) -> tuple[str, str]:
    """(parent location, name) of a checkpoint location: where its `LATEST`
    goes and what it says.  `InvalidRequest` if there is no parent to use."""
    text = location.rstrip("/")
    scheme, sep, rest = text.partition("://")
    base = rest if sep else text
    parent, slash, name = base.rpartition("/")
    if sep and slash and not parent and base.startswith("/"):
        parent = "/"  # file:///name
    if not slash or not name or (sep and not parent):
        raise InvalidRequest(f"checkpoint location {location!r} has no parent to hold LATEST")
    if not sep:
        return parent or "/", name
    return f"{scheme}://{parent}" if parent != "/" else f"{scheme}:///", name


def join_location(root: str, name: str) -> str:
    return f"{root}{name}" if root.endswith("/") else f"{root}/{name}"


# --- LATEST -------------------------------------------------------------------


def write_latest(blobs: Blobs, name: str, checkpoint_id: str) -> None:
    """Point `LATEST` at `name` (atomic: readers see the old or the new one)."""
    blobs.replace(LATEST_KEY, msgspec.json.encode(LatestPointer(name, checkpoint_id)) + b"\n")


def write_latest_for(checkpoint_dir: str, checkpoint_id: str) -> None:
    """After the Gym manifest of `checkpoint_dir`: its parent's `LATEST` names it."""
    from ray_ckpt.storage.locations import open_location

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
