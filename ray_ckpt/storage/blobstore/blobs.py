"""The byte store under a checkpoint location: a local directory or an object-store prefix.

Everything that reads or writes a checkpoint (participant records and
manifests, the Gym manifest, `LATEST`, listing and garbage collection) goes
through a `Blobs`: named byte objects under one root, keys relative to it with
`/` between parts.  The guarantees the checkpoint format needs are stated
here once, and each backend says how it keeps them:

- `create` publishes a small object only if its key is free, atomically, and
  reports what is there otherwise (a manifest is created, never replaced);
- `upload` streams a large object that becomes visible whole or not at all,
  only when the block exits cleanly (records files);
- `replace` atomically swaps a small pointer object (`LATEST`);
- a `read`/`stream` of a key returns exactly the bytes one writer published.

Every backend raises typed errors only: `BlobMissing` for an absent key,
`InvalidRequest` for a location that cannot be used (no permission, no such
bucket, a path through a file), `ParticipantUnavailable` for a failure that
may heal (disk full, an endpoint down), `InvalidCheckpointState` for a taken
key or an aborted fsync.

This module holds the protocol; `locations` parses a location into one of
the backends beside it.  Keys never start with `/` and never hold `..` (`check_key`).
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import msgspec

from ray_ckpt.errors import InvalidCheckpointState, InvalidRequest


class BlobMissing(InvalidCheckpointState):
    """The key holds nothing (for a manifest: not committed)."""


class BlobInfo(msgspec.Struct, frozen=True):
    key: str
    size: int
    modified: float  # seconds since the epoch


class Upload(Protocol):
    def write(self, data: bytes | bytearray | memoryview) -> None: ...


class Blobs(Protocol):
    """One checkpoint root.  Synchronous: callers run it in a thread."""

    @property
    def url(self) -> str:
        """The location as the user named it, for messages (never credentials)."""
        ...

    def read(self, key: str) -> bytes:
        """The whole object; `BlobMissing` if absent."""
        ...

    def stream(self, key: str) -> Iterator[bytes]:
        """The object in chunks, for a streaming verify; `BlobMissing` if absent."""
        ...

    def read_range_into(self, key: str, start: int, buf: bytearray | memoryview) -> memoryview:
        """`len(buf)` bytes from `start` into `buf`, one ranged read: the view
        of what was read (shorter if the object ends first); `BlobMissing` if
        absent.  An incremental restore fetches only the frames it
        references, into a few buffers it reuses: fresh memory for each read
        would fault every page in anew (costly on a VM: `direct_io`)."""
        ...

    def create(self, key: str, data: bytes) -> bytes | None:
        """Publish `data` at `key` unless taken: None if this call published,
        else the bytes already there (the caller decides if they are equal)."""
        ...

    def replace(self, key: str, data: bytes) -> None:
        """Atomically set a small object (readers see the old or the new)."""
        ...

    def upload(
        self,
        key: str,
        *,
        before_publish: Callable[[], object] | None = None,
        sync_name: bool = True,
    ) -> contextlib.AbstractContextManager[Upload]:
        """Stream a new object: visible whole at `key` on a clean exit, never
        partly; on an exception nothing is published.  A taken key raises
        `InvalidCheckpointState`.

        `sync_name=False`: the caller `create`s an object in the same folder
        next, and that create's directory fsync makes both names durable
        (on disk one fsync fewer per commit; a store's completed upload is
        durable by itself).  Safe for a records file: until the manifest that
        names it exists nothing reads it, and the manifest is only durable
        with that same fsync.

        `before_publish` runs on the caller's thread at the exit, after every
        byte was written (on disk: and fsynced; on a store: handed to the
        upload, whose last parts and completion follow) and before the object
        can become visible: if it raises, nothing is published.  A
        `WriteStop` takes its lock there, so on a store `stop()` may wait for
        the tail of an upload."""
        ...

    def list(self, prefix: str = "") -> list[BlobInfo]:
        """Every object under `prefix` (recursive), sorted by key.  The prefix
        names a folder: "a" and "a/" both mean the keys "a/...", never "ab"."""
        ...

    def delete(self, keys: Sequence[str]) -> None:
        """Delete in batches; keys already gone are fine."""
        ...

    def info(self, key: str) -> BlobInfo:
        """Size and time of one object; `BlobMissing` if absent."""
        ...

    def exists(self, key: str) -> bool: ...


def check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise InvalidCheckpointState(f"bad storage key {key!r}")
    return key


# A writer's temp object: `.<name>.<32 hex>.tmp` beside the final name.  A
# crash can leave one behind; garbage collection recognises it by name.
_TEMP_RE = re.compile(r"\..+\.[0-9a-f]{32}\.tmp")


def temp_key(key: str) -> str:
    """A fresh temp key beside `key`: unique per call, so no writer (on this
    host or another sharing the store) ever reuses or removes another's."""
    parent, _, name = check_key(key).rpartition("/")
    tmp = f".{name}.{uuid.uuid4().hex}.tmp"
    return f"{parent}/{tmp}" if parent else tmp


def is_temp(key: str) -> bool:
    """True for a key `temp_key` made: a write in flight or left by a crash."""
    return _TEMP_RE.fullmatch(key.rpartition("/")[2]) is not None


def blob_name(blobs: Blobs, key: str) -> str:
    """`key` under the user's location, for messages: `/ck/gym/a/0/manifest.json`,
    `s3://bucket/run/gym/a/0/manifest.json`."""
    return f"{blobs.url.rstrip('/')}/{key}"


SCHEMES = ("file", "s3", "gs")


def refuse(location: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"checkpoint location {location!r} {why}")
