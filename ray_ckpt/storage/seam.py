"""The storage seam the engine writes and reads records through.

`FileRecordStore` is the real one (durable, manifest-last objects under
`<location>/gym/<kind>/<instance>/` on disk or in an object store, see
`ray_ckpt.storage`); unit tests of the
pure engine logic may pass an in-memory store instead.  Both are
synchronous: the engine runs them in a thread under the call's deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ray_ckpt.storage.blobstore.location_errors import directory_errors
from ray_ckpt.storage.records.record import Record

_KEEP = 2  # commits remembered per participant as incremental bases


class StopHandle(Protocol):
    def stop(self) -> None: ...


class RecordStore(Protocol):
    def new_stop(self) -> StopHandle: ...

    def write(
        self,
        checkpoint_dir: str,
        *,
        kind: str,
        instance: str,
        checkpoint_id: str,
        records: Sequence[Record],
        stop: StopHandle,
    ) -> Any:
        """Durably write the records (and their attachments: each record's
        files, stored by digest), then the manifest; return the manifest."""
        ...

    def read(
        self,
        checkpoint_dir: str,
        *,
        kind: str,
        instance: str,
        select: Callable[[str], bool],
        attachments_dir: str | None = None,
    ) -> tuple[Any, list[Record]]:
        """Verify and read one participant's records; return (manifest, in-scope records).

        Records come back with their `attachments` as verified local files;
        those fetched from a remote store go into `attachments_dir` (None: a
        new temporary folder the caller owns)."""
        ...


class FileRecordStore:
    """Records through `ray_ckpt.storage` (imported lazily: it is heavy), at
    any location `open_location` takes: a local path or an object-store URI.

    A location that cannot be written or read is a typed error naming it
    (`ray_ckpt.storage.blobstore.location_errors`), never a raw `OSError` or a store's own
    exception.

    Incremental: the store remembers the last checkpoint each participant
    committed through it, and the next write references that one's
    unchanged records (`ray_ckpt.storage.participant.incremental`) when it is still
    complete (its Gym manifest lists the very manifest written); a new
    process, or a checkpoint that never completed, writes a full one.
    `full_every` and `min_live_fraction` bound the chains (`ChainPolicy`;
    the settings' `incremental_*` fields); `full_every=1` writes every
    checkpoint in full.
    """

    def __init__(self, *, full_every: int = 8, min_live_fraction: float = 0.5) -> None:
        self._policy: Any = None  # built at the first write: storage is imported lazily
        self._bounds = (full_every, min_live_fraction)
        # (kind, instance) -> its last `_KEEP` commits through this store, newest
        # first: after a checkpoint that never completed, the one before it
        # is still a base, so an aborted checkpoint does not force a full one.
        self._last: dict[tuple[str, str], list[Any]] = {}

    def new_stop(self) -> StopHandle:
        from ray_ckpt.storage import WriteStop

        return WriteStop()

    def write(
        self,
        checkpoint_dir: str,
        *,
        kind: str,
        instance: str,
        checkpoint_id: str,
        records: Sequence[Record],
        stop: StopHandle,
    ) -> Any:
        from ray_ckpt.storage import WriteStop, write_participant
        from ray_ckpt.storage.participant.incremental import ChainPolicy, Previous

        assert isinstance(stop, WriteStop)
        if self._policy is None:
            self._policy = ChainPolicy(*self._bounds)
        with directory_errors(checkpoint_dir, "written"):
            manifest = write_participant(
                checkpoint_dir,
                kind=kind,
                instance=instance,
                checkpoint_id=checkpoint_id,
                records=records,
                stop=stop,
                # Every checkpoint full, or nothing to write: no previous
                # one to compare with (and no earlier manifests to read).
                previous=self._previous(kind, instance)
                if self._policy.full_every > 1 and records
                else None,
                policy=self._policy,
                # Nothing will reference these frames when every checkpoint is full.
                frame_index=self._policy.full_every > 1,
            )
        mine = [Previous(location=checkpoint_dir, manifest=manifest)]
        mine += [p for p in self._last.get((kind, instance), []) if p.location != checkpoint_dir]
        self._last[(kind, instance)] = mine[:_KEEP]
        return manifest

    def _previous(self, kind: str, instance: str) -> Any:
        """The newest commit through this store whose checkpoint completed with it."""
        from ray_ckpt.errors import CheckpointError
        from ray_ckpt.storage import open_location, read_gym_manifest
        from ray_ckpt.storage.root.gym_manifest import listed_manifest

        for prev in self._last.get((kind, instance), []):
            try:
                blobs = open_location(prev.location)
                gym = read_gym_manifest(blobs)
                listed = listed_manifest(blobs, gym, gym.entry(kind, instance))
            except CheckpointError:
                continue  # incomplete, gone or unreadable: not a base
            if listed == prev.manifest:
                return prev
        return None  # none: write a full one

    def read(
        self,
        checkpoint_dir: str,
        *,
        kind: str,
        instance: str,
        select: Callable[[str], bool],
        attachments_dir: str | None = None,
    ) -> tuple[Any, list[Record]]:
        """Read one participant, cross-checked against the Gym manifest when there is one.

        The coordinator always writes (and on restore requires) the Gym manifest;
        a engine that does not write one (NeMo Gym's own coordination) gets
        the participant's manifest checked alone.  When the Gym manifest exists,
        this participant must be listed in it with the same manifest digest, so
        a participant directory from another commit is never installed.

        Attachments: on a local disk each path is the verified blob object
        itself (the install must copy, never change it); from an object
        store, a verified download into `attachments_dir`
        (`participant_store.read_records`).
        """
        from ray_ckpt.storage import load_manifest, open_location, read_gym_manifest
        from ray_ckpt.storage.participant.participant_store import read_records
        from ray_ckpt.storage.root.gym_manifest import has_gym_manifest, listed_manifest

        with directory_errors(checkpoint_dir, "read"):
            blobs = open_location(checkpoint_dir)
            if has_gym_manifest(blobs):
                gym = read_gym_manifest(blobs)
                manifest = listed_manifest(blobs, gym, gym.entry(kind, instance))
            else:
                manifest = load_manifest(blobs, kind=kind, instance=instance, checkpoint_id=None)
            records = read_records(blobs, manifest, select, attachments_dir=attachments_dir)
            return manifest, records
