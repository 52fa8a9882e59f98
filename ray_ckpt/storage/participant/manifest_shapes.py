"""Participant manifests of either shape: ours, or NeMo Gym's.

NeMo Gym's participants write `records_sha256`, `record_count` and
`records-<sha>.jsonl` (legacy `records.jsonl`), no `bytes`; ours carry a
digest algorithm, a byte count and `records-<token>.msgpack`.  The Gym
manifest lists both (`summarize_manifest`) and a verify checks both
(`verify_participant`).  A checkpoint NeMo Gym's controller wrote has no Gym
manifest; `read_participant_manifests` reads such a one for a restore that
explicitly allows it.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import msgspec

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage.blobstore.blobs import BlobMissing, Blobs, blob_name
from ray_ckpt.storage.participant.attachments import own_blob_bytes, verify_blobs
from ray_ckpt.storage.participant.participant_manifest import (
    DIGEST_ALGOS,
    GYM,
    RECORDS_RE,
    SCHEMA_VERSION,
    Where,
    blobs_of,
    load_manifest,
    manifest_bytes,
)
from ray_ckpt.storage.participant.participant_store import read_records

_FOREIGN_RECORDS = re.compile(r"records-[0-9a-f]{64}\.jsonl|records\.jsonl")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ManifestSummary(msgspec.Struct, frozen=True):
    """What the Gym manifest needs from a participant manifest of either shape."""

    kind: str
    instance: str
    checkpoint_id: str
    records_file: str
    records_digest: str
    record_count: int
    bytes: int
    ours: bool  # our own shape (its records can be verified record by record)
    blob_bytes: int = 0  # the attachment blobs it holds itself (ours only)


def json_object(data: bytes, where: str) -> dict[str, Any]:
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise InvalidCheckpointState(f"corrupt manifest {where}: {exc}") from exc
    if not isinstance(obj, dict):
        raise InvalidCheckpointState(f"corrupt manifest {where}: not a JSON object")
    return obj


def summarize_manifest(
    checkpoint_dir: Where, kind: str, instance: str, data: bytes, key: str
) -> ManifestSummary:
    """Validate the fields every participant manifest has (ours or NeMo Gym's).

    Bytes come from the manifest when it says (ours), else from the records
    object's size (NeMo Gym's); a records object that is missing is refused
    either way."""
    blobs = blobs_of(checkpoint_dir)
    path = blob_name(blobs, key)
    m = json_object(data, path)
    if m.get("schema_version") != SCHEMA_VERSION:
        raise InvalidCheckpointState(
            f"unknown manifest schema version {m.get('schema_version')!r} in {path}"
        )
    if m.get("kind") != kind or m.get("instance") != instance:
        raise InvalidCheckpointState(f"manifest {path} is not {kind}/{instance}'s")
    cid, records_file, count = m.get("checkpoint_id"), m.get("records_file"), m.get("record_count")
    if not isinstance(cid, str) or not cid:
        raise InvalidCheckpointState(f"manifest {path} names no checkpoint ID")
    if not isinstance(records_file, str) or not (
        RECORDS_RE.fullmatch(records_file) or _FOREIGN_RECORDS.fullmatch(records_file)
    ):
        raise InvalidCheckpointState(f"bad records file name {records_file!r} in {path}")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise InvalidCheckpointState(f"bad record_count {count!r} in {path}")
    ours = "digest_algo" in m
    digest = m.get("digest") if ours else m.get("records_sha256")
    if ours and m.get("digest_algo") not in DIGEST_ALGOS:
        raise InvalidCheckpointState(f"unknown digest {m.get('digest_algo')!r} in {path}")
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise InvalidCheckpointState(f"bad records digest {digest!r} in {path}")
    records = f"{key.rpartition('/')[0]}/{records_file}"
    try:
        size = blobs.info(records).size
    except BlobMissing:
        raise InvalidCheckpointState(
            f"records file {blob_name(blobs, records)} is missing"
        ) from None
    said = m.get("bytes")
    if isinstance(said, int) and not isinstance(said, bool):
        if said != size:
            raise InvalidCheckpointState(
                f"truncated or extended records {blob_name(blobs, records)}: {size} bytes, "
                f"manifest says {said}"
            )
    elif said is not None:
        raise InvalidCheckpointState(f"bad bytes {said!r} in {path}")
    return ManifestSummary(
        kind=kind,
        instance=instance,
        checkpoint_id=cid,
        records_file=records_file,
        records_digest=digest,
        record_count=count,
        bytes=size,
        ours=ours,
        blob_bytes=own_blob_bytes(m),
    )


def _verify_foreign_records(blobs: Blobs, pkey: str, summary: ManifestSummary) -> None:
    """NeMo Gym's JSON-lines records: digest, size and line count over the whole object."""
    key = f"{pkey}/{summary.records_file}"
    name = blob_name(blobs, key)
    h = hashlib.sha256()
    size = lines = 0
    carry = b""
    try:
        chunks = blobs.stream(key)
    except BlobMissing:
        raise InvalidCheckpointState(f"records file {name} is missing") from None
    for chunk in chunks:
        h.update(chunk)
        size += len(chunk)
        *complete, carry = (carry + chunk).split(b"\n")
        lines += sum(1 for line in complete if line.strip())
    lines += bool(carry.strip())
    if h.hexdigest() != summary.records_digest:
        raise InvalidCheckpointState(f"digest mismatch in {name}: records are corrupt")
    if size != summary.bytes:
        raise InvalidCheckpointState(f"records {name} changed size while read")
    if lines != summary.record_count:
        raise InvalidCheckpointState(
            f"records {name} hold {lines} records, manifest lists {summary.record_count}"
        )


def verify_participant(
    checkpoint_dir: Where,
    kind: str,
    instance: str,
    *,
    checkpoint_id: str | None,
    read: tuple[str, bytes] | None = None,
) -> ManifestSummary:
    """A participant manifest of either shape and its whole records object,
    and every attachment blob it lists, verified (and, if given, that it
    belongs to `checkpoint_id`)."""
    blobs = blobs_of(checkpoint_dir)
    key, data = read or manifest_bytes(blobs, kind, instance)
    summary = summarize_manifest(blobs, kind, instance, data, key)
    if checkpoint_id is not None and summary.checkpoint_id != checkpoint_id:
        raise InvalidCheckpointState(
            f"manifest {blob_name(blobs, key)} is for checkpoint {summary.checkpoint_id!r}, "
            f"not {checkpoint_id!r}"
        )
    if summary.ours:
        manifest = load_manifest(
            blobs, kind=kind, instance=instance, checkpoint_id=checkpoint_id, read=(key, data)
        )
        # Digest and count are verified over every byte; states need not be
        # decoded.  Every attachment blob is read and hashed too (a restore
        # fetches only those of the episodes it continues).
        read_records(blobs, manifest, select=lambda _key: False)
        verify_blobs(blobs, manifest)
    else:
        _verify_foreign_records(blobs, key.rpartition("/")[0], summary)
    return summary


def present_participants(checkpoint_dir: Where) -> set[tuple[str, str]]:
    """Every (kind, instance) that has any object under ``gym/<kind>/<instance>/``."""
    found: set[tuple[str, str]] = set()
    for info in blobs_of(checkpoint_dir).list(GYM):
        parts = info.key.split("/")
        hidden = any(p.startswith((".", "_")) for p in parts[1:3])
        if len(parts) >= 4 and not hidden:
            found.add((parts[1], parts[2]))
    return found


def read_participant_manifests(
    checkpoint_dir: Where,
) -> tuple[str, dict[tuple[str, str], ManifestSummary]]:
    """A checkpoint without a Gym manifest (NeMo Gym's controller writes none):
    every participant manifest under ``gym/``, each complete and all of one
    checkpoint ID; (that ID, the manifests by (kind, instance)).

    Complete as far as is cheap to tell without reading the records: the
    manifest parses, names its own kind and instance, and its records object
    is there (with the size the manifest says, when it says one).  Each
    participant still verifies its records in full when it restores."""
    blobs = blobs_of(checkpoint_dir)
    found: dict[tuple[str, str], ManifestSummary] = {}
    for kind, instance in sorted(present_participants(blobs)):
        key, data = manifest_bytes(blobs, kind, instance)
        found[(kind, instance)] = summarize_manifest(blobs, kind, instance, data, key)
    if not found:
        raise InvalidCheckpointState(f"no participant manifest under {blob_name(blobs, GYM)}")
    ids = {m.checkpoint_id for m in found.values()}
    if len(ids) != 1:
        by = ", ".join(f"{k}/{i}: {m.checkpoint_id}" for (k, i), m in sorted(found.items()))
        raise InvalidCheckpointState(
            f"participant manifests under {blob_name(blobs, GYM)} belong to different "
            f"checkpoints ({by})"
        )
    return ids.pop(), found
