"""A participant's manifest: its shape, its keys, and how it is read and checked.

Layout under a checkpoint location: ``gym/<kind>/<instance>/manifest.json``
beside the records object it names and the attachments' blob objects
(``blobs/<digest>``, `attachments`).  The manifest is the commit point of a
participant's write (`participant_store`): created last and never replaced,
so no manifest means "not committed".
"""

from __future__ import annotations

import os
import pathlib
import re

import msgspec

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.identity import ID_PATTERN
from ray_ckpt.storage.blobstore.blobs import BlobMissing, Blobs, blob_name
from ray_ckpt.storage.blobstore.locations import open_location
from ray_ckpt.storage.records.records_format import (
    FORMAT,
    FRAMES_DIGEST,
    SHA256_FRAMES_DIGEST,
    WHOLE_FILE_DIGEST,
)

SCHEMA_VERSION = 1
# The records file's digest: over its frames' BLAKE3 digests (`records_format`).
# Manifests written before say "sha256-frames" (the same with sha256) or
# "sha256" (the whole file's); both still read.
DIGEST_ALGO = FRAMES_DIGEST
DIGEST_ALGOS = (DIGEST_ALGO, SHA256_FRAMES_DIGEST, WHOLE_FILE_DIGEST)
GYM = "gym"
MANIFEST_NAME = "manifest.json"
_NAME_RE = re.compile(ID_PATTERN)
# New records objects are named by a random token (a multipart upload needs
# its key before the digest is known); older ones by their sha256.  Both are
# plain names in the participant's own folder.  Always fullmatch.
RECORDS_RE = re.compile(r"records-([0-9a-f]{32}|[0-9a-f]{64})\.msgpack")

# An attachment's name: the BLAKE3 digest of its bytes, lowercase hex.
DIGEST_RE = re.compile(r"[0-9a-f]{64}")
BLOBS = "blobs"

# Where a checkpoint is: a location string (or path) as every public function
# takes it, or a `Blobs` already open (so one call opens its location once).
Where = str | os.PathLike[str] | Blobs


class Frame(msgspec.Struct, frozen=True, array_like=True):
    """Where one record sits in this manifest's own records file.

    `digest` is the sha256 of the frame's bytes (header, key and state), so
    a later checkpoint can reference the frame and a restore verify exactly
    the bytes it fetches with one ranged read.  `version` is the exporter's
    version of the state (`Record.version`), None if it gave none."""

    key: str
    offset: int
    length: int
    digest: str
    version: str | None = None


class FrameRef(msgspec.Struct, frozen=True, array_like=True):
    """A record left unchanged, held by an earlier checkpoint's records file.

    Always the file that holds the bytes (`checkpoint` is a sibling name
    under the same root, the folder is this participant's own), never another
    manifest: a restore reads it directly and never walks a chain."""

    checkpoint: str
    records_file: str
    file_digest: str
    file_bytes: int
    key: str
    offset: int
    length: int
    digest: str
    version: str | None = None


class BlobRef(msgspec.Struct, frozen=True, array_like=True):
    """One attachment's blob object: ``<checkpoint>/gym/<kind>/<instance>/blobs/<digest>``.

    `checkpoint` is the manifest's own `checkpoint_id` for an object this
    checkpoint holds, else the sibling checkpoint's name (a folder under the
    same root) that holds it: flattened like a `FrameRef`, never a chain.  A
    writer never references a sibling whose name is its own checkpoint ID
    (it writes that blob again), so the two never mix."""

    checkpoint: str
    digest: str
    bytes: int


class ParticipantManifest(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a committed participant checkpoint holds; written last.

    `episodes` and `record_count` cover every record, own and referenced;
    `digest`, `bytes` and `frames` describe the own records file only.  The
    fields from `frames` on are absent from older manifests (no frame index:
    such a checkpoint is never referenced, the next one is written in full).

    Attachments (`Record.attachments`) are absent unless a record has some,
    so a manifest without them is byte for byte what it was before them:
    `attachments` maps a capture key to its digests (sorted), `blobs` lists
    every digest any record names once (sorted by digest) with the object
    holding it, and `blob_bytes` adds up the objects this checkpoint holds
    itself.  They are manifest fields, not `Frame` fields: a frame is an
    array whose trailing defaults would be dropped too (its `version`)."""

    schema_version: int
    checkpoint_id: str
    kind: str
    instance: str
    records_file: str
    digest_algo: str
    digest: str
    record_count: int
    episodes: list[str]  # capture keys, sorted
    bytes: int
    format: str
    frames: list[Frame] = []
    refs: list[FrameRef] = []
    chain_depth: int = 0  # checkpoints since the last full rewrite (0: this is one)
    attachments: dict[str, list[str]] = {}
    blobs: list[BlobRef] = []
    blob_bytes: int = 0

    def own_blob(self, ref: BlobRef) -> bool:
        """True if this checkpoint holds the object itself (not a sibling)."""
        return ref.checkpoint == self.checkpoint_id


class _Versioned(msgspec.Struct):
    schema_version: int


def blobs_of(where: Where) -> Blobs:
    if isinstance(where, (str, os.PathLike)):
        return open_location(where)
    return where


def encode_manifest(manifest: msgspec.Struct) -> bytes:
    return msgspec.json.format(msgspec.json.encode(manifest), indent=1) + b"\n"


def check_name(what: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or len(name) > 255:
        raise InvalidCheckpointState(f"bad {what} name {name!r}: must match {ID_PATTERN}")
    return name


def participant_key(kind: str, instance: str) -> str:
    """``gym/<kind>/<instance>``; names that could escape it are refused."""
    return f"{GYM}/{check_name('kind', kind)}/{check_name('instance', instance)}"


def blob_key(pkey: str, digest: str) -> str:
    """``<pkey>/blobs/<digest>``: an attachment's object in a participant's folder."""
    return f"{pkey}/{BLOBS}/{digest}"


def participant_dir(
    checkpoint_dir: str | os.PathLike[str], kind: str, instance: str
) -> pathlib.Path:
    """The participant's folder as a local path (for a local location)."""
    return pathlib.Path(checkpoint_dir) / participant_key(kind, instance)


def decode_manifest(data: bytes, where: str) -> ParticipantManifest:
    try:
        version = msgspec.json.decode(data, type=_Versioned).schema_version
    except msgspec.DecodeError as exc:
        raise InvalidCheckpointState(f"corrupt manifest {where}: {exc}") from exc
    if version != SCHEMA_VERSION:
        raise InvalidCheckpointState(f"unknown manifest schema version {version} in {where}")
    try:
        manifest = msgspec.json.decode(data, type=ParticipantManifest)
    except msgspec.DecodeError as exc:
        raise InvalidCheckpointState(f"corrupt manifest {where}: {exc}") from exc
    if manifest.format != FORMAT:
        raise InvalidCheckpointState(f"unknown records format {manifest.format!r} in {where}")
    if manifest.digest_algo not in DIGEST_ALGOS:
        raise InvalidCheckpointState(f"unknown digest {manifest.digest_algo!r} in {where}")
    if not RECORDS_RE.fullmatch(manifest.records_file):
        raise InvalidCheckpointState(f"bad records file name {manifest.records_file!r} in {where}")
    for ref in manifest.refs:
        # A reference names a sibling checkpoint and a plain records name: it
        # can never point outside the root or into another participant.
        if not _NAME_RE.fullmatch(ref.checkpoint) or not RECORDS_RE.fullmatch(ref.records_file):
            raise InvalidCheckpointState(
                f"bad reference {ref.checkpoint}/{ref.records_file} in {where}"
            )
        if (
            min(ref.offset, ref.length, ref.file_bytes) < 0
            or ref.offset + ref.length > ref.file_bytes
        ):
            raise InvalidCheckpointState(f"bad frame range for {ref.key} in {where}")
    _check_attachments(manifest, where)
    return manifest


def _check_attachments(manifest: ParticipantManifest, where: str) -> None:
    """Every blob names a plain digest in a sibling checkpoint's folder (never
    outside the root), once; every record's digest is one of them."""
    listed: set[str] = set()
    for ref in manifest.blobs:
        if (
            not DIGEST_RE.fullmatch(ref.digest)
            or not _NAME_RE.fullmatch(ref.checkpoint)
            or ref.bytes < 0
        ):
            raise InvalidCheckpointState(
                f"bad blob {ref.checkpoint}/{ref.digest} ({ref.bytes} bytes) in {where}"
            )
        if ref.digest in listed:
            raise InvalidCheckpointState(f"blob {ref.digest} listed twice in {where}")
        listed.add(ref.digest)
    if manifest.blob_bytes < 0:
        raise InvalidCheckpointState(f"bad blob_bytes {manifest.blob_bytes} in {where}")
    episodes = set(manifest.episodes) if manifest.attachments else set()
    for key, digests in manifest.attachments.items():
        if key not in episodes:
            raise InvalidCheckpointState(f"attachments of {key}, not a record, in {where}")
        missing = [d for d in digests if d not in listed]
        if missing:
            raise InvalidCheckpointState(
                f"attachment {missing[0][:64]!r} of {key} is not a listed blob in {where}"
            )


def manifest_bytes(checkpoint_dir: Where, kind: str, instance: str) -> tuple[str, bytes]:
    """The key and exact bytes of one participant's manifest (missing: not committed)."""
    blobs = blobs_of(checkpoint_dir)
    key = f"{participant_key(kind, instance)}/{MANIFEST_NAME}"
    try:
        return key, blobs.read(key)
    except BlobMissing:
        raise InvalidCheckpointState(
            f"missing manifest {blob_name(blobs, key)}: not committed"
        ) from None


def load_manifest(
    checkpoint_dir: Where,
    *,
    kind: str,
    instance: str,
    checkpoint_id: str | None,
    read: tuple[str, bytes] | None = None,
) -> ParticipantManifest:
    """The validated manifest of one participant (no records read).

    `read` is what `manifest_bytes` already returned, so a caller that hashed
    those bytes validates the same ones instead of reading the object again.
    """
    blobs = blobs_of(checkpoint_dir)
    key, data = read or manifest_bytes(blobs, kind, instance)
    name = blob_name(blobs, key)
    manifest = decode_manifest(data, name)
    if (manifest.kind, manifest.instance) != (kind, instance):
        raise InvalidCheckpointState(
            f"manifest {name} is for {manifest.kind}/{manifest.instance}, not {kind}/{instance}"
        )
    if checkpoint_id is not None and manifest.checkpoint_id != checkpoint_id:
        raise InvalidCheckpointState(
            f"manifest {name} is for checkpoint {manifest.checkpoint_id!r}, not {checkpoint_id!r}"
        )
    return manifest
