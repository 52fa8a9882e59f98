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

Attachments (`attachments`) follow the same base: a digest the previous
manifest lists (as its own blob or as a reference) is referenced, flattened
to the checkpoint that holds the object, if the object is still there at its
size; any other is written.  A blob is referenced whenever the base is safe,
even when the records are all written again (a changed record may name
mostly unchanged files), and a full rewrite writes every blob again.

Chains are bounded (`ChainPolicy`, defaults `FULL_EVERY` = 8 and
`MIN_LIVE_FRACTION` = 0.5): a full rewrite when the previous one is already
`full_every - 1` checkpoints past its last full rewrite (so checkpoints 0, K,
2K, ... of a run are full), or when the referenced bytes are less than
`min_live_fraction` of the bytes of the files they point into (the old
files are then kept alive mostly for records that have since changed).

What a restore verifies is in `referenced`, which reads them back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from ray_ckpt.errors import InvalidCheckpointState, InvalidRequest
from ray_ckpt.storage.blobstore.blobs import BlobMissing, Blobs
from ray_ckpt.storage.blobstore.durable import WriteStop
from ray_ckpt.storage.blobstore.locations import open_location, split_location
from ray_ckpt.storage.participant.participant_manifest import (
    BLOBS,
    DIGEST_ALGO,
    MANIFEST_NAME,
    RECORDS_RE,
    BlobRef,
    FrameRef,
    ParticipantManifest,
    blob_key,
    check_name,
    decode_manifest,
    participant_key,
)
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.records.records_format import StateEncoder, frame_hash

FULL_EVERY = 8
MIN_LIVE_FRACTION = 0.5


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
    """An incremental write: the records referenced, frames already encoded,
    and the attachments' blobs referenced (by digest)."""

    refs: dict[str, FrameRef]
    encoded: dict[str, bytes]
    depth: int
    blobs: dict[str, BlobRef] = {}


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


def root_of(here: Blobs) -> Blobs:
    """The root above a checkpoint location: where its siblings are."""
    return open_location(split_location(here.url)[0])


def plan(
    here: Blobs,
    *,
    kind: str,
    instance: str,
    checkpoint_id: str,
    records: Sequence[Record],
    previous: Previous | None,
    policy: ChainPolicy,
    stop: WriteStop,
) -> Plan | None:
    """What to reference instead of writing, or None for a full checkpoint."""
    if previous is None:
        return None
    prev = previous.manifest
    depth = prev.chain_depth + 1
    name = _sibling(here.url, previous.location)
    # A manifest without a frame index (an older one) is never a base; one
    # whose records are all referenced (nothing changed) is: its references
    # are copied, already flattened.
    if name is None or depth >= policy.full_every or not (prev.frames or prev.refs):
        return None
    if prev.digest_algo != DIGEST_ALGO:
        # Its frames' digests are another hash: a manifest's references are
        # always in its own `digest_algo`, so the chain starts over here.
        return None
    root = root_of(here)
    pdir = f"{name}/{participant_key(kind, instance)}"
    try:
        stored = decode_manifest(root.read(f"{pdir}/{MANIFEST_NAME}"), pdir)
    except InvalidCheckpointState:
        return None  # gone, or unreadable: nothing safe to point into
    if stored != prev:
        return None
    refs, encoded = _record_refs(root, kind, instance, name, prev, records, policy, stop)
    blobs = _blob_refs(root, kind, instance, name, prev, records, checkpoint_id)
    if not refs and not blobs:
        return None
    return Plan(refs=refs, encoded=encoded, depth=depth, blobs=blobs)


def _record_refs(
    root: Blobs,
    kind: str,
    instance: str,
    name: str,
    prev: ParticipantManifest,
    records: Sequence[Record],
    policy: ChainPolicy,
    stop: WriteStop,
) -> tuple[dict[str, FrameRef], dict[str, bytes]]:
    """The unchanged records to reference and the changed ones already
    encoded; no references when they would keep too little alive."""
    known = candidates(name, prev)
    refs: dict[str, FrameRef] = {}
    encoded: dict[str, bytes] = {}
    encoder = StateEncoder()
    digest = frame_hash(DIGEST_ALGO)
    for rec in records:
        stop.check()  # the digest path encodes every state: a stop must not wait for it
        cand = known.get(rec.key)
        if cand is None:
            continue
        if rec.version is not None:
            if cand.version == rec.version:
                refs[rec.key] = cand
            continue
        try:
            frame = b"".join(encoder.frame(rec.key, rec.state))
        except (TypeError, ValueError, OverflowError):
            continue  # the write refuses it, naming the episode
        if len(frame) == cand.length and digest(frame).hex() == cand.digest:
            refs[rec.key] = cand
        else:
            encoded[rec.key] = frame
    files = {(r.checkpoint, r.records_file): r.file_bytes for r in refs.values()}
    live = sum(r.length for r in refs.values())
    if not refs or live < policy.min_live_fraction * sum(files.values()):
        return {}, encoded
    for (ck, records_file), size in files.items():
        key = f"{ck}/{participant_key(kind, instance)}/{records_file}"
        try:
            if root.info(key).size != size:
                return {}, encoded
        except BlobMissing:
            return {}, encoded
    return refs, encoded


def _blob_refs(
    root: Blobs,
    kind: str,
    instance: str,
    name: str,
    prev: ParticipantManifest,
    records: Sequence[Record],
    checkpoint_id: str,
) -> dict[str, BlobRef]:
    """The attachments the previous checkpoint already stores (own or
    referenced), each as a reference to the checkpoint holding its object,
    if that object is still there at its size (one listing per holder).
    A whole object is either needed or not, so no live fraction applies."""
    wanted = {d for r in records for d in (r.attachments or {})}
    pkey = participant_key(kind, instance)
    by_holder: dict[str, list[BlobRef]] = {}
    for ref in prev.blobs:
        holder = name if prev.own_blob(ref) else ref.checkpoint
        # A holder named like this checkpoint's ID would read as its own blob.
        if ref.digest in wanted and holder != checkpoint_id:
            by_holder.setdefault(holder, []).append(ref)
    out: dict[str, BlobRef] = {}
    for holder, refs in by_holder.items():
        sizes = {i.key: i.size for i in root.list(f"{holder}/{pkey}/{BLOBS}")}
        for ref in refs:
            if sizes.get(f"{holder}/{blob_key(pkey, ref.digest)}") == ref.bytes:
                out[ref.digest] = BlobRef(holder, ref.digest, ref.bytes)
    return out


def same_records(prior: ParticipantManifest, records: Sequence[Record], stop: WriteStop) -> bool:
    """True if `records` are what `prior` (with a frame index) committed: a
    retried commit returns it without writing a second records file."""
    if sorted(r.key for r in records) != prior.episodes:
        return False
    known = candidates("", prior)  # the name is unused: only digests are compared
    encoder = StateEncoder()
    digest = frame_hash(prior.digest_algo)
    for rec in records:
        stop.check()
        cand = known[rec.key]
        if rec.version is not None and cand.version == rec.version:
            continue
        try:
            frame = b"".join(encoder.frame(rec.key, rec.state))
        except (TypeError, ValueError, OverflowError):
            return False
        if digest(frame).hex() != cand.digest:
            return False
    return True


def referenced_files(manifest: Mapping[str, Any]) -> set[tuple[str, str]]:
    """(checkpoint, records file) of every reference in a raw manifest object.

    Lenient on purpose: garbage collection asks it which files to keep, so an
    entry it cannot read is skipped rather than failing the scan (the restore
    of that checkpoint refuses it, naming what is wrong)."""
    found: set[tuple[str, str]] = set()
    refs = manifest.get("refs")
    for ref in refs if isinstance(refs, list) else ():
        pair = (ref[0], ref[1]) if isinstance(ref, list) and len(ref) >= 2 else None
        if pair is not None and _plain(*pair):
            found.add(pair)
    return found


def _plain(checkpoint: object, records_file: object) -> bool:
    if not isinstance(checkpoint, str) or not isinstance(records_file, str):
        return False
    try:
        check_name("checkpoint", checkpoint)
    except InvalidCheckpointState:
        return False
    return RECORDS_RE.fullmatch(records_file) is not None
