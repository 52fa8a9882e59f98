"""The Gym manifest: written last of all, it lists every participant manifest.

A checkpoint is complete only when ``<dir>/gym/_manifest.json`` exists; it
names each participant and the sha256 of its ``manifest.json``, so a restore
can tell a participant that is missing, torn, or present but never part of
this checkpoint.  The leading underscore keeps the name out of the kind
namespace (kinds must start with a letter or digit).

Participant manifests may be ours or NeMo Gym's (`records_sha256`,
`record_count`, `records-<sha>.jsonl`, no `bytes`): both are listed and
verified (`summarize_manifest`, `verify_participant`).  A directory NeMo
Gym's controller wrote has no Gym manifest; `read_participant_manifests`
reads such a one for a restore that explicitly allows it.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage import durable
from ray_ckpt.storage.participant_store import (
    SCHEMA_VERSION,
    ParticipantManifest,
    check_name,
    encode_manifest,
    load_manifest,
    manifest_bytes,
    read_records,
)

GYM_MANIFEST_NAME = "_manifest.json"


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
    return pathlib.Path(checkpoint_dir) / "gym" / GYM_MANIFEST_NAME


def write_gym_manifest(
    checkpoint_dir: str | os.PathLike[str],
    *,
    checkpoint_id: str,
    manifests: Sequence[ParticipantManifest | Mapping[str, Any]],
) -> GymManifest:
    """Create the Gym manifest over committed participant manifests (never replaced).

    Each manifest is ours (`ParticipantManifest`, or its JSON as a commit reply
    carries it) or NeMo Gym's (`records_sha256`, `record_count`,
    `records-<sha>.jsonl`, no `bytes`): it is listed by the digest of its bytes
    on disk, which must be the manifest the participant committed."""
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
        path, data = manifest_bytes(checkpoint_dir, kind, instance)
        if _json_object(data, path) != dict(reply):
            raise InvalidCheckpointState(f"manifest {path} differs from the committed one")
        summary = summarize_manifest(checkpoint_dir, kind, instance, data, path)
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
    )
    final = gym_manifest_path(checkpoint_dir)
    durable.ensure_dir(final.parent)
    existing = durable.create_never_replace(final, encode_manifest(gym))
    if existing is not None and _decode_gym(existing, final) != gym:
        raise InvalidCheckpointState(
            f"{final} already holds a different checkpoint; a manifest is never replaced"
        )
    return gym


# --- participant manifests of either shape -----------------------------------

# NeMo Gym names its records `records-<sha256>.jsonl` (legacy `records.jsonl`);
# ours are `records-<sha256>.msgpack`.  Either way a plain name in the
# participant's own directory.
_RECORDS_NAME = re.compile(r"records-[0-9a-f]{64}\.(jsonl|msgpack)|records\.jsonl")
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


def _json_object(data: bytes, path: pathlib.Path) -> dict[str, Any]:
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise InvalidCheckpointState(f"corrupt manifest {path}: {exc}") from exc
    if not isinstance(obj, dict):
        raise InvalidCheckpointState(f"corrupt manifest {path}: not a JSON object")
    return obj


def summarize_manifest(
    checkpoint_dir: str | os.PathLike[str],
    kind: str,
    instance: str,
    data: bytes,
    path: pathlib.Path,
) -> ManifestSummary:
    """Validate the fields every participant manifest has (ours or NeMo Gym's).

    Bytes come from the manifest when it says (ours), else from the records
    file's size on disk (NeMo Gym's); a records file that is missing is
    refused either way."""
    m = _json_object(data, path)
    if m.get("schema_version") != SCHEMA_VERSION:
        raise InvalidCheckpointState(
            f"unknown manifest schema version {m.get('schema_version')!r} in {path}"
        )
    if m.get("kind") != kind or m.get("instance") != instance:
        raise InvalidCheckpointState(f"manifest {path} is not {kind}/{instance}'s")
    cid, records_file, count = m.get("checkpoint_id"), m.get("records_file"), m.get("record_count")
    if not isinstance(cid, str) or not cid:
        raise InvalidCheckpointState(f"manifest {path} names no checkpoint ID")
    if not isinstance(records_file, str) or not _RECORDS_NAME.fullmatch(records_file):
        raise InvalidCheckpointState(f"bad records file name {records_file!r} in {path}")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise InvalidCheckpointState(f"bad record_count {count!r} in {path}")
    ours = "digest_algo" in m
    digest = m.get("digest") if ours else m.get("records_sha256")
    if ours and m.get("digest_algo") != "sha256":
        raise InvalidCheckpointState(f"unknown digest {m.get('digest_algo')!r} in {path}")
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise InvalidCheckpointState(f"bad records digest {digest!r} in {path}")
    records = path.parent / records_file
    try:
        size = records.stat().st_size
    except FileNotFoundError:
        raise InvalidCheckpointState(f"records file {records} is missing") from None
    said = m.get("bytes")
    if isinstance(said, int) and not isinstance(said, bool):
        if said != size:
            raise InvalidCheckpointState(
                f"truncated or extended records {records}: {size} bytes, manifest says {said}"
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
    )


def _verify_foreign_records(pdir: pathlib.Path, summary: ManifestSummary) -> None:
    """NeMo Gym's JSON-lines records: digest, size and line count over the whole file."""
    path = pdir / summary.records_file
    h = hashlib.sha256()
    size = lines = 0
    try:
        with path.open("rb") as f:
            for line in f:
                h.update(line)
                size += len(line)
                lines += bool(line.strip())
    except FileNotFoundError:
        raise InvalidCheckpointState(f"records file {path} is missing") from None
    if h.hexdigest() != summary.records_digest:
        raise InvalidCheckpointState(f"digest mismatch in {path}: records are corrupt")
    if size != summary.bytes:
        raise InvalidCheckpointState(f"records {path} changed size while read")
    if lines != summary.record_count:
        raise InvalidCheckpointState(
            f"records {path} hold {lines} records, manifest lists {summary.record_count}"
        )


def verify_participant(
    checkpoint_dir: str | os.PathLike[str],
    kind: str,
    instance: str,
    *,
    checkpoint_id: str | None,
    read: tuple[pathlib.Path, bytes] | None = None,
) -> ManifestSummary:
    """A participant manifest of either shape and its whole records file,
    verified (and, if given, that it belongs to `checkpoint_id`)."""
    path, data = read or manifest_bytes(checkpoint_dir, kind, instance)
    summary = summarize_manifest(checkpoint_dir, kind, instance, data, path)
    if checkpoint_id is not None and summary.checkpoint_id != checkpoint_id:
        raise InvalidCheckpointState(
            f"manifest {path} is for checkpoint {summary.checkpoint_id!r}, not {checkpoint_id!r}"
        )
    if summary.ours:
        manifest = load_manifest(
            checkpoint_dir,
            kind=kind,
            instance=instance,
            checkpoint_id=checkpoint_id,
            read=(path, data),
        )
        # Digest and count are verified over every byte; states need not be decoded.
        read_records(checkpoint_dir, manifest, select=lambda _key: False)
    else:
        _verify_foreign_records(path.parent, summary)
    return summary


def _decode_gym(data: bytes, path: pathlib.Path) -> GymManifest:
    try:
        gym = msgspec.json.decode(data, type=GymManifest)
    except msgspec.DecodeError as exc:
        raise InvalidCheckpointState(f"corrupt Gym manifest {path}: {exc}") from exc
    if gym.schema_version != SCHEMA_VERSION:
        raise InvalidCheckpointState(
            f"unknown Gym manifest schema version {gym.schema_version} in {path}"
        )
    for e in gym.participants:
        check_name("kind", e.kind)
        check_name("instance", e.instance)
    return gym


def read_gym_manifest(checkpoint_dir: str | os.PathLike[str]) -> GymManifest:
    path = gym_manifest_path(checkpoint_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InvalidCheckpointState(
            f"missing Gym manifest {path}: checkpoint incomplete or absent"
        ) from None
    return _decode_gym(data, path)


def listed_manifest(
    checkpoint_dir: str | os.PathLike[str], gym: GymManifest, e: GymEntry
) -> ParticipantManifest:
    """The manifest of a participant the Gym manifest lists, checked against its
    digest there and its checkpoint ID (the file is read once: the hashed
    bytes are the ones validated)."""
    read = manifest_bytes(checkpoint_dir, e.kind, e.instance)
    path, data = read
    if hashlib.sha256(data).hexdigest() != e.manifest_digest:
        raise InvalidCheckpointState(f"manifest {path} does not match the Gym manifest's digest")
    return load_manifest(
        checkpoint_dir,
        kind=e.kind,
        instance=e.instance,
        checkpoint_id=gym.checkpoint_id,
        read=read,
    )


def _check_listed(checkpoint_dir: str | os.PathLike[str], gym: GymManifest, e: GymEntry) -> None:
    path, data = manifest_bytes(checkpoint_dir, e.kind, e.instance)
    if hashlib.sha256(data).hexdigest() != e.manifest_digest:
        raise InvalidCheckpointState(f"manifest {path} does not match the Gym manifest's digest")
    verify_participant(
        checkpoint_dir, e.kind, e.instance, checkpoint_id=gym.checkpoint_id, read=(path, data)
    )


def _present(checkpoint_dir: str | os.PathLike[str]) -> set[tuple[str, str]]:
    root = pathlib.Path(checkpoint_dir) / "gym"
    found: set[tuple[str, str]] = set()
    if not root.is_dir():
        return found
    for kind_dir in root.iterdir():
        if kind_dir.is_dir() and not kind_dir.name.startswith((".", "_")):
            found.update(
                (kind_dir.name, d.name)
                for d in kind_dir.iterdir()
                if d.is_dir() and not d.name.startswith((".", "_"))
            )
    return found


def _check_entry(
    checkpoint_dir: str | os.PathLike[str], gym: GymManifest, e: GymEntry
) -> ParticipantCheck:
    try:
        _check_listed(checkpoint_dir, gym, e)
        error = None
    except InvalidCheckpointState as exc:
        error = exc.detail
    return ParticipantCheck(
        kind=e.kind,
        instance=e.instance,
        listed=True,
        ok=error is None,
        episodes=e.record_count,
        bytes=e.bytes,
        digest=e.records_digest,
        error=error,
    )


def _unlisted(checkpoint_dir: str | os.PathLike[str], kind: str, instance: str) -> ParticipantCheck:
    error = "participant directory is not listed in the Gym manifest"
    try:
        path, data = manifest_bytes(checkpoint_dir, kind, instance)
        m = summarize_manifest(checkpoint_dir, kind, instance, data, path)
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
        bytes=m.bytes,
        digest=m.records_digest,
        error=f"{error} (its manifest is for checkpoint {m.checkpoint_id!r})",
    )


def read_participant_manifests(
    checkpoint_dir: str | os.PathLike[str],
) -> tuple[str, dict[tuple[str, str], ManifestSummary]]:
    """A checkpoint without a Gym manifest (NeMo Gym's controller writes none):
    every participant manifest under ``<dir>/gym/``, each complete and all of
    one checkpoint ID; (that ID, the manifests by (kind, instance)).

    Complete as far as is cheap to tell without reading the records: the
    manifest parses, names its own kind and instance, and its records file is
    there (with the size the manifest says, when it says one).  Each
    participant still verifies its records in full when it restores."""
    found: dict[tuple[str, str], ManifestSummary] = {}
    for kind, instance in sorted(_present(checkpoint_dir)):
        path, data = manifest_bytes(checkpoint_dir, kind, instance)
        found[(kind, instance)] = summarize_manifest(checkpoint_dir, kind, instance, data, path)
    if not found:
        raise InvalidCheckpointState(f"no participant manifest under {checkpoint_dir}/gym")
    ids = {m.checkpoint_id for m in found.values()}
    if len(ids) != 1:
        by = ", ".join(f"{k}/{i}: {m.checkpoint_id}" for (k, i), m in sorted(found.items()))
        raise InvalidCheckpointState(
            f"participant manifests under {checkpoint_dir}/gym belong to different "
            f"checkpoints ({by})"
        )
    return ids.pop(), found


def verify_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> CheckpointReport:
    """Check every listed participant in full; report unlisted or broken ones."""
    errors: list[str] = []
    checks: list[ParticipantCheck] = []
    try:
        gym: GymManifest | None = read_gym_manifest(checkpoint_dir)
    except InvalidCheckpointState as exc:
        gym = None
        errors.append(exc.detail)
    if gym is not None:
        checks.extend(_check_entry(checkpoint_dir, gym, e) for e in gym.participants)
    listed = {(c.kind, c.instance) for c in checks}
    checks.extend(
        _unlisted(checkpoint_dir, kind, instance)
        for kind, instance in sorted(_present(checkpoint_dir) - listed)
    )
    ok = gym is not None and not errors and all(c.ok for c in checks)
    return CheckpointReport(
        ok=ok,
        checkpoint_id=gym.checkpoint_id if gym is not None else None,
        participants=checks,
        errors=errors,
    )
