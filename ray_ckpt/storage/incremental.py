"""Incremental checkpoints: write the changed records, reference the rest.

A participant's next checkpoint writes only the records whose state changed
since the checkpoint it committed last (`Previous`); every other record is a
`FrameRef`: the earlier records file that holds its bytes (by name, digest and
size), the frame's offset and length, and the sha256 of the frame's bytes.
References are flattened: one copied from the previous manifest keeps
pointing at the file holding the bytes, so a restore reads each record from
its file directly and never walks a chain of manifests.

Change detection, cheapest first:

- a `Record.version` the exporter gives (e.g. the episode's boundary sequence
  number): equal to the version stored with the previous frame means
  unchanged, and the state is not even encoded;
- no version: the state is encoded and the frame's sha256 compared with the
  previous frame's digest (encode and hash, but nothing written).  Changed
  frames keep their encoding for the write, so nothing is encoded twice.

Only a previous checkpoint that is safe to point into is used: a sibling
under the same root (the same backend, since the root is one location), its
manifest still there and equal to the one this participant committed, with a
frame index (older manifests have none), and every file its references need
still there at the size recorded.  Anything else writes a full checkpoint.

Chains are bounded (`ChainPolicy`, defaults `FULL_EVERY` = 8 and
`MIN_LIVE_FRACTION` = 0.5): a full rewrite when the previous one is already
`full_every - 1` checkpoints past its last full rewrite (so checkpoints 0, K,
2K, ... of a run are full), or when the referenced bytes are less than
`min_live_fraction` of the bytes of the files they point into (the old
files are then kept alive mostly for records that have since changed).

What a restore verifies (`read_refs`): each referenced file exists with the
size recorded; each frame's bytes, fetched with a ranged read, have the
sha256 recorded and hold the expected key and lengths.  The whole old file is
not re-hashed: its own digest was verified when it was written and by any
restore of its own checkpoint, and the frame digest covers every byte this
restore uses.  A missing file or a bad frame refuses the whole restore.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import msgspec

from ray_ckpt.errors import InvalidCheckpointState, InvalidRequest
from ray_ckpt.storage.blobs import BlobMissing, Blobs, blob_name
from ray_ckpt.storage.durable import WriteStop
from ray_ckpt.storage.locations import open_location
from ray_ckpt.storage.participant_manifest import (
    MANIFEST_NAME,
    FrameRef,
    ParticipantManifest,
    decode_manifest,
    participant_key,
)
from ray_ckpt.storage.pointer import split_location
from ray_ckpt.storage.record import Record
from ray_ckpt.storage.records_format import FRAME, StateEncoder, decode_state

FULL_EVERY = 8
MIN_LIVE_FRACTION = 0.5
# Adjacent referenced frames are fetched in one ranged read up to this size,
# and across gaps up to `_GAP` (a few wasted bytes beat one more round trip).
_MAX_READ = 16 << 20
_GAP = 1 << 20
_READERS = 2


class ChainPolicy(msgspec.Struct, frozen=True):
    """When an incremental checkpoint is written in full instead."""

    full_every: int = FULL_EVERY
    min_live_fraction: float = MIN_LIVE_FRACTION

    def __post_init__(self) -> None:
        if self.full_every < 1 or not 0.0 <= self.min_live_fraction <= 1.0:
            raise ValueError("full_every must be >= 1 and min_live_fraction in [0, 1]")


class Previous(msgspec.Struct, frozen=True):
    """The checkpoint this participant committed last: its location and the
    manifest `write_participant` returned for it."""

    location: str
    manifest: ParticipantManifest


class Plan(msgspec.Struct, frozen=True):
    """An incremental write: the records referenced, and frames already encoded."""

    refs: dict[str, FrameRef]
    encoded: dict[str, bytes]
    depth: int


def candidates(name: str, manifest: ParticipantManifest) -> dict[str, FrameRef]:
    """Every record of `manifest` (checkpoint `name`) as a reference to its bytes."""
    out = {r.key: r for r in manifest.refs}
    for f in manifest.frames:
        out[f.key] = FrameRef(
            checkpoint=name,
            records_file=manifest.records_file,
            file_digest=manifest.digest,
            file_bytes=manifest.bytes,
            key=f.key,
            offset=f.offset,
            length=f.length,
            digest=f.digest,
            version=f.version,
        )
    return out


def _sibling(here: str, there: str) -> str | None:
    """The previous checkpoint's name if it sits beside `here` under one root."""
    try:
        (root, name), (root2, name2) = split_location(here), split_location(there)
    except InvalidRequest:  # no parent: nothing to point into
        return None
    return name2 if root == root2 and name != name2 else None


def plan(
    here: Blobs,
    *,
    kind: str,
    instance: str,
    records: Sequence[Record],
    previous: Previous | None,
    policy: ChainPolicy,
) -> Plan | None:
    """What to reference instead of writing, or None for a full checkpoint."""
    if previous is None:
        return None
    prev = previous.manifest
    depth = prev.chain_depth + 1
    name = _sibling(here.url, previous.location)
    if name is None or depth >= policy.full_every or not prev.frames or prev.bytes <= 0:
        return None
    root = _root(here)
    pdir = f"{name}/{participant_key(kind, instance)}"
    try:
        stored = decode_manifest(root.read(f"{pdir}/{MANIFEST_NAME}"), pdir)
    except InvalidCheckpointState:
        return None  # gone, or unreadable: nothing safe to point into
    if stored != prev:
        return None
    known = candidates(name, prev)
    refs: dict[str, FrameRef] = {}
    encoded: dict[str, bytes] = {}
    encoder = StateEncoder()
    for rec in records:
        cand = known.get(rec.key)
        if cand is None:
            continue
        if rec.version is not None:
            if cand.version == rec.version:
                refs[rec.key] = cand
            continue
        frame = bytearray()
        try:
            encoder.append(frame, rec.key, rec.state)
        except (TypeError, ValueError, OverflowError):
            continue  # the write refuses it, naming the episode
        if len(frame) == cand.length and hashlib.sha256(frame).hexdigest() == cand.digest:
            refs[rec.key] = cand
        else:
            encoded[rec.key] = bytes(frame)
    files = {(r.checkpoint, r.records_file): r.file_bytes for r in refs.values()}
    live = sum(r.length for r in refs.values())
    if not refs or live < policy.min_live_fraction * sum(files.values()):
        return None
    for (ck, records_file), size in files.items():
        key = f"{ck}/{participant_key(kind, instance)}/{records_file}"
        try:
            if root.info(key).size != size:
                return None
        except BlobMissing:
            return None
    return Plan(refs=refs, encoded=encoded, depth=depth)


def _root(here: Blobs) -> Blobs:
    return open_location(split_location(here.url)[0])


def read_refs(
    here: Blobs, manifest: ParticipantManifest, select: Callable[[str], bool] | None
) -> dict[str, Record]:
    """Fetch and verify every referenced frame; the records `select` keeps.

    Raises `InvalidCheckpointState` naming the file for a missing or resized
    file, or a frame whose bytes differ from the digest recorded."""
    if not manifest.refs:
        return {}
    root = _root(here)
    pkey = participant_key(manifest.kind, manifest.instance)
    by_file: dict[str, list[FrameRef]] = {}
    for ref in manifest.refs:
        by_file.setdefault(f"{ref.checkpoint}/{pkey}/{ref.records_file}", []).append(ref)
    reads: list[tuple[str, list[FrameRef]]] = []
    for key, refs in by_file.items():
        name = blob_name(root, key)
        try:
            size = root.info(key).size
        except BlobMissing:
            raise InvalidCheckpointState(f"referenced records file {name} is missing") from None
        if size != refs[0].file_bytes:
            raise InvalidCheckpointState(
                f"referenced records file {name} is {size} bytes, manifest says "
                f"{refs[0].file_bytes}"
            )
        reads.extend((key, group) for group in _coalesce(refs))
    kept: dict[str, Record] = {}
    with ThreadPoolExecutor(_READERS, thread_name_prefix="ray-ckpt-refs") as pool:
        for key, group, data in pool.map(lambda r: _fetch(root, *r), reads):
            for ref, frame in _frames(root, key, group, data):
                if select is None or select(ref.key):
                    try:
                        kept[ref.key] = Record(ref.key, decode_state(frame))
                    except (msgspec.DecodeError, ValueError) as exc:
                        raise InvalidCheckpointState(
                            f"corrupt record {ref.key} in {blob_name(root, key)}: {exc}"
                        ) from exc
    return kept


def _coalesce(refs: list[FrameRef]) -> Iterator[list[FrameRef]]:
    group: list[FrameRef] = []
    for ref in sorted(refs, key=lambda r: r.offset):
        if group:
            start, end = group[0].offset, group[-1].offset + group[-1].length
            if ref.offset - end > _GAP or ref.offset + ref.length - start > _MAX_READ:
                yield group
                group = []
        group.append(ref)
    if group:
        yield group


def _fetch(root: Blobs, key: str, group: list[FrameRef]) -> tuple[str, list[FrameRef], bytes]:
    start = group[0].offset
    end = max(r.offset + r.length for r in group)
    try:
        data = root.read_range(key, start, end - start)
    except BlobMissing:
        raise InvalidCheckpointState(
            f"referenced records file {blob_name(root, key)} is missing"
        ) from None
    # Hashed here, on the reader threads (hashlib releases the GIL).
    for ref in group:
        view = memoryview(data)[ref.offset - start : ref.offset - start + ref.length]
        if len(view) != ref.length or hashlib.sha256(view).hexdigest() != ref.digest:
            raise InvalidCheckpointState(
                f"digest mismatch in {blob_name(root, key)} at offset {ref.offset} "
                f"(record {ref.key}): referenced records are corrupt"
            )
    return key, group, data


def _frames(
    root: Blobs, key: str, group: list[FrameRef], data: bytes
) -> Iterator[tuple[FrameRef, memoryview]]:
    """Each verified frame's state bytes, after checking its header names it."""
    start = group[0].offset
    view = memoryview(data)
    for ref in group:
        at = ref.offset - start
        key_len, state_len = FRAME.unpack_from(view, at) if ref.length >= FRAME.size else (0, -1)
        head = at + FRAME.size
        if FRAME.size + key_len + state_len != ref.length or bytes(
            view[head : head + key_len]
        ) != ref.key.encode("utf-8"):
            raise InvalidCheckpointState(
                f"frame at offset {ref.offset} of {blob_name(root, key)} is not record {ref.key}"
            )
        yield ref, view[head + key_len : at + ref.length]


def same_records(prior: ParticipantManifest, records: Sequence[Record], stop: WriteStop) -> bool:
    """True if `records` are what `prior` (with a frame index) committed: a
    retried commit returns it without writing a second records file."""
    if sorted(r.key for r in records) != prior.episodes:
        return False
    known = candidates("", prior)  # the name is unused: only digests are compared
    encoder = StateEncoder()
    for rec in records:
        stop.check()
        cand = known[rec.key]
        if rec.version is not None and cand.version == rec.version:
            continue
        frame = bytearray()
        try:
            encoder.append(frame, rec.key, rec.state)
        except (TypeError, ValueError, OverflowError):
            return False
        if hashlib.sha256(frame).hexdigest() != cand.digest:
            return False
    return True
