"""The Gym manifest: written last of all, it lists every participant manifest.

A checkpoint is complete only when ``<dir>/gym/_manifest.json`` exists; it
names each participant and the sha256 of its ``manifest.json``, so a restore
can tell a participant that is missing, torn, or present but never part of
this checkpoint.  The leading underscore keeps the name out of the kind
namespace (kinds must start with a letter or digit).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Sequence

import msgspec

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage import durable
from ray_ckpt.storage.participant_store import (
    SCHEMA_VERSION,
    ParticipantManifest,
    check_name,
    decode_manifest,
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
    manifests: Sequence[ParticipantManifest],
) -> GymManifest:
    """Create the Gym manifest over committed participant manifests (never replaced)."""
    entries: dict[tuple[str, str], GymEntry] = {}
    for m in manifests:
        if m.checkpoint_id != checkpoint_id:
            raise InvalidCheckpointState(
                f"participant {m.kind}/{m.instance} committed checkpoint {m.checkpoint_id!r}, "
                f"not {checkpoint_id!r}"
            )
        if (m.kind, m.instance) in entries:
            raise InvalidCheckpointState(f"participant {m.kind}/{m.instance} is listed twice")
        path, data = manifest_bytes(checkpoint_dir, m.kind, m.instance)
        if decode_manifest(data, str(path)) != m:
            raise InvalidCheckpointState(f"manifest {path} differs from the committed one")
        entries[(m.kind, m.instance)] = GymEntry(
            kind=m.kind,
            instance=m.instance,
            manifest_digest=hashlib.sha256(data).hexdigest(),
            records_digest=m.digest,
            record_count=m.record_count,
            bytes=m.bytes,
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
    manifest = listed_manifest(checkpoint_dir, gym, e)
    # Digest and count are verified over every byte; states need not be decoded.
    read_records(checkpoint_dir, manifest, select=lambda _key: False)


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
        m = load_manifest(checkpoint_dir, kind=kind, instance=instance, checkpoint_id=None)
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
        digest=m.digest,
        error=f"{error} (its manifest is for checkpoint {m.checkpoint_id!r})",
    )


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
