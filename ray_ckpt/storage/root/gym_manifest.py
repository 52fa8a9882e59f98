"""The Gym manifest: written last of all, it lists every participant manifest.

A checkpoint is complete only when ``<location>/gym/_manifest.json`` exists;
it names each participant and the sha256 of its ``manifest.json``, so a
restore can tell a participant that is missing, torn, or present but never
part of this checkpoint.  The leading underscore keeps the name out of the
kind namespace (kinds must start with a letter or digit).  Like a
participant manifest it is created, never replaced: a create-only link on
disk, a conditional put on an object store (see `participant_store`).

Participant manifests may be ours or NeMo Gym's; `manifest_shapes` reads both.

`written_at` records when the Gym manifest was written (epoch seconds, full
precision): the listing's time of an object is whole seconds on S3, so two
checkpoints published in the same second could not be told apart by it
(`catalog` orders by this field; older manifests without it, by the listing).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage.blobstore.blobs import BlobMissing, Blobs, blob_name
from ray_ckpt.storage.participant.manifest_shapes import (
    ManifestSummary,
    json_object,
    present_participants,
    read_participant_manifests,
    summarize_manifest,
    verify_participant,
)
from ray_ckpt.storage.participant.participant_manifest import (
    GYM,
    SCHEMA_VERSION,
    ParticipantManifest,
    Where,
    blobs_of,
    check_name,
    encode_manifest,
    load_manifest,
    manifest_bytes,
)

__all__ = [
    "GYM_MANIFEST_KEY",
    "GYM_MANIFEST_NAME",
    "CheckpointReport",
    "GymEntry",
    "GymManifest",
    "ManifestSummary",
    "ParticipantCheck",
    "gym_manifest_path",
    "has_gym_manifest",
    "listed_manifest",
    "read_gym_manifest",
    "read_participant_manifests",
    "summarize_manifest",
    "verify_checkpoint",
    "verify_participant",
    "write_gym_manifest",
]

GYM_MANIFEST_NAME = "_manifest.json"
GYM_MANIFEST_KEY = f"{GYM}/{GYM_MANIFEST_NAME}"


class GymEntry(msgspec.Struct, frozen=True):
    kind: str
    instance: str
    manifest_digest: str  # sha256 of the participant's manifest.json bytes
    records_digest: str
    record_count: int
    bytes: int


class GymManifest(msgspec.Struct, frozen=True):
    schema_version: int
    checkpoint_id: str
    participants: list[GymEntry]
    # When it was written (epoch s); None in manifests written before the field.
    written_at: float | None = None

    def entry(self, kind: str, instance: str) -> GymEntry:
        """The listed participant, or `InvalidCheckpointState` if it is not listed."""
        for e in self.participants:
            if e.kind == kind and e.instance == instance:
                return e
        raise InvalidCheckpointState(
            f"participant {kind}/{instance} is missing from the Gym manifest of "
            f"checkpoint {self.checkpoint_id!r}"
        )


class ParticipantCheck(msgspec.Struct, frozen=True):
    kind: str
    instance: str
    listed: bool
    ok: bool
    episodes: int = 0
    bytes: int = 0
    digest: str = ""
    error: str | None = None


class CheckpointReport(msgspec.Struct, frozen=True):
    ok: bool
    checkpoint_id: str | None
    participants: list[ParticipantCheck]
    errors: list[str]


def gym_manifest_path(checkpoint_dir: str | os.PathLike[str]) -> pathlib.Path:
    """The Gym manifest as a local path (for a local location; else `has_gym_manifest`)."""
    return pathlib.Path(checkpoint_dir) / GYM_MANIFEST_KEY


def has_gym_manifest(checkpoint_dir: Where) -> bool:
    return blobs_of(checkpoint_dir).exists(GYM_MANIFEST_KEY)


def write_gym_manifest(
    checkpoint_dir: Where,
    *,
    checkpoint_id: str,
    manifests: Sequence[ParticipantManifest | Mapping[str, Any]],
    now: float | None = None,
) -> GymManifest:
    """Create the Gym manifest over committed participant manifests (never replaced).

    `now`: the time it records as written (default: the wall clock).  A retry
    that finds the same manifest written returns that one, its time included.

    Each manifest is ours (`ParticipantManifest`, or its JSON as a commit reply
    carries it) or NeMo Gym's (`records_sha256`, `record_count`,
    `records-<sha>.jsonl`, no `bytes`): it is listed by the digest of its bytes
    as stored, which must be the manifest the participant committed."""
    blobs = blobs_of(checkpoint_dir)
    entries: dict[tuple[str, str], GymEntry] = {}
    for m in manifests:
        reply = msgspec.to_builtins(m) if isinstance(m, ParticipantManifest) else m
        if not isinstance(reply, Mapping):
            raise InvalidCheckpointState(f"a participant manifest is not an object: {m!r}"[:300])
        kind, instance = reply.get("kind"), reply.get("instance")
        if not isinstance(kind, str) or not isinstance(instance, str):
            raise InvalidCheckpointState(
                f"a participant manifest names no kind/instance: {dict(reply)!r}"[:300]
            )
        check_name("kind", kind)
        check_name("instance", instance)
        if reply.get("checkpoint_id") != checkpoint_id:
            raise InvalidCheckpointState(
                f"participant {kind}/{instance} committed checkpoint "
                f"{reply.get('checkpoint_id')!r}, not {checkpoint_id!r}"
            )
        if (kind, instance) in entries:
            raise InvalidCheckpointState(f"participant {kind}/{instance} is listed twice")
        key, data = manifest_bytes(blobs, kind, instance)
        if json_object(data, blob_name(blobs, key)) != dict(reply):
            raise InvalidCheckpointState(
                f"manifest {blob_name(blobs, key)} differs from the committed one"
            )
        summary = summarize_manifest(blobs, kind, instance, data, key)
        entries[(kind, instance)] = GymEntry(
            kind=kind,
            instance=instance,
            manifest_digest=hashlib.sha256(data).hexdigest(),
            records_digest=summary.records_digest,
            record_count=summary.record_count,
            bytes=summary.bytes,
        )
    gym = GymManifest(
        schema_version=SCHEMA_VERSION,
        checkpoint_id=checkpoint_id,
        participants=[entries[k] for k in sorted(entries)],
        written_at=time.time() if now is None else now,
    )
    existing = blobs.create(GYM_MANIFEST_KEY, encode_manifest(gym))
    if existing is None:
        return gym
    found = _decode_gym(existing, blobs)
    if msgspec.structs.replace(found, written_at=None) != msgspec.structs.replace(
        gym, written_at=None
    ):
        raise InvalidCheckpointState(
            f"{blob_name(blobs, GYM_MANIFEST_KEY)} already holds a different checkpoint; "
            "a manifest is never replaced"
        )
    return found


def _decode_gym(data: bytes, blobs: Blobs) -> GymManifest:
    where = blob_name(blobs, GYM_MANIFEST_KEY)
    try:
        gym = msgspec.json.decode(data, type=GymManifest)
    except msgspec.DecodeError as exc:
        raise InvalidCheckpointState(f"corrupt Gym manifest {where}: {exc}") from exc
    if gym.schema_version != SCHEMA_VERSION:
        raise InvalidCheckpointState(
            f"unknown Gym manifest schema version {gym.schema_version} in {where}"
        )
    for e in gym.participants:
        check_name("kind", e.kind)
        check_name("instance", e.instance)
    return gym


def read_gym_manifest(checkpoint_dir: Where) -> GymManifest:
    blobs = blobs_of(checkpoint_dir)
    try:
        data = blobs.read(GYM_MANIFEST_KEY)
    except BlobMissing:
        raise InvalidCheckpointState(
            f"missing Gym manifest {blob_name(blobs, GYM_MANIFEST_KEY)}: checkpoint "
            "incomplete or absent"
        ) from None
    return _decode_gym(data, blobs)


def listed_manifest(checkpoint_dir: Where, gym: GymManifest, e: GymEntry) -> ParticipantManifest:
    """The manifest of a participant the Gym manifest lists, checked against its
    digest there and its checkpoint ID (the object is read once: the hashed
    bytes are the ones validated)."""
    blobs = blobs_of(checkpoint_dir)
    read = _listed_bytes(blobs, e)
    return load_manifest(
        blobs, kind=e.kind, instance=e.instance, checkpoint_id=gym.checkpoint_id, read=read
    )


def _listed_bytes(blobs: Blobs, e: GymEntry) -> tuple[str, bytes]:
    key, data = manifest_bytes(blobs, e.kind, e.instance)
    if hashlib.sha256(data).hexdigest() != e.manifest_digest:
        raise InvalidCheckpointState(
            f"manifest {blob_name(blobs, key)} does not match the Gym manifest's digest"
        )
    return key, data


def _check_entry(blobs: Blobs, gym: GymManifest, e: GymEntry) -> ParticipantCheck:
    blob_bytes = 0
    try:
        read = _listed_bytes(blobs, e)
        summary = verify_participant(
            blobs, e.kind, e.instance, checkpoint_id=gym.checkpoint_id, read=read
        )
        blob_bytes = summary.blob_bytes
        error = None
    except InvalidCheckpointState as exc:
        error = exc.detail
    return ParticipantCheck(
        kind=e.kind,
        instance=e.instance,
        listed=True,
        ok=error is None,
        episodes=e.record_count,
        # Its records and the attachment blobs it holds itself, as a
        # checkpoint's size counts everywhere (`catalog.CheckpointEntry`).
        bytes=e.bytes + blob_bytes,
        digest=e.records_digest,
        error=error,
    )


def _unlisted(blobs: Blobs, kind: str, instance: str) -> ParticipantCheck:
    error = "participant directory is not listed in the Gym manifest"
    try:
        key, data = manifest_bytes(blobs, kind, instance)
        m = summarize_manifest(blobs, kind, instance, data, key)
    except InvalidCheckpointState as exc:
        return ParticipantCheck(
            kind, instance, listed=False, ok=False, error=f"{error}; {exc.detail}"
        )
    return ParticipantCheck(
        kind,
        instance,
        listed=False,
        ok=False,
        episodes=m.record_count,
        bytes=m.bytes + m.blob_bytes,
        digest=m.records_digest,
        error=f"{error} (its manifest is for checkpoint {m.checkpoint_id!r})",
    )


def verify_checkpoint(checkpoint_dir: Where) -> CheckpointReport:
    """Check every listed participant in full; report unlisted or broken ones."""
    blobs = blobs_of(checkpoint_dir)
    errors: list[str] = []
    checks: list[ParticipantCheck] = []
    try:
        gym: GymManifest | None = read_gym_manifest(blobs)
    except InvalidCheckpointState as exc:
        gym = None
        errors.append(exc.detail)
    if gym is not None:
        checks.extend(_check_entry(blobs, gym, e) for e in gym.participants)
    listed = {(c.kind, c.instance) for c in checks}
    checks.extend(
        _unlisted(blobs, kind, instance)
        for kind, instance in sorted(present_participants(blobs) - listed)
    )
    ok = gym is not None and not errors and all(c.ok for c in checks)
    return CheckpointReport(
        ok=ok,
        checkpoint_id=gym.checkpoint_id if gym is not None else None,
        participants=checks,
        errors=errors,
    )
