"""One participant's checkpoint: a streamed records file, then its manifest.

Layout: ``<dir>/gym/<kind>/<instance>/records-<sha256>.msgpack`` and
``manifest.json``.  The manifest is the commit point: it is created last and
never replaced, so no manifest means "not committed", and a manifest always
names a complete, fsynced records file.  Reads verify the digest, size and
count over the whole file in one streaming pass and decode only the records
the caller keeps.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import uuid
from collections.abc import Callable, Iterable

import msgspec

from ray_ckpt.errors import CheckpointError, InvalidCheckpointState
from ray_ckpt.identity import ID_PATTERN, EpisodeId
from ray_ckpt.storage import durable
from ray_ckpt.storage.durable import WriteStop
from ray_ckpt.storage.pipeline import CHUNK, HashingReader, HashingWriter
from ray_ckpt.storage.record import Record
from ray_ckpt.storage.records_format import FORMAT, FRAME, MAGIC, StateEncoder, decode_state

SCHEMA_VERSION = 1
DIGEST_ALGO = "sha256"
MANIFEST_NAME = "manifest.json"
_NAME_RE = re.compile(ID_PATTERN)
_RECORDS_RE = re.compile(r"records-[0-9a-f]{64}\.msgpack")  # always fullmatch


class ParticipantManifest(msgspec.Struct, frozen=True):
    """What a committed participant checkpoint holds; written last."""

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


class _Versioned(msgspec.Struct):
    schema_version: int


def encode_manifest(manifest: msgspec.Struct) -> bytes:
    return msgspec.json.format(msgspec.json.encode(manifest), indent=1) + b"\n"


def check_name(what: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or len(name) > 255:
        raise InvalidCheckpointState(f"bad {what} name {name!r}: must match {ID_PATTERN}")
    return name


def participant_dir(
    checkpoint_dir: str | os.PathLike[str], kind: str, instance: str
) -> pathlib.Path:
    """``<dir>/gym/<kind>/<instance>``; names that could escape it are refused."""
    return (
        pathlib.Path(checkpoint_dir)
        / "gym"
        / check_name("kind", kind)
        / check_name("instance", instance)
    )


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
    if manifest.digest_algo != DIGEST_ALGO:
        raise InvalidCheckpointState(f"unknown digest {manifest.digest_algo!r} in {where}")
    if not _RECORDS_RE.fullmatch(manifest.records_file):
        raise InvalidCheckpointState(f"bad records file name {manifest.records_file!r} in {where}")
    return manifest


def manifest_bytes(
    checkpoint_dir: str | os.PathLike[str], kind: str, instance: str
) -> tuple[pathlib.Path, bytes]:
    """The path and exact bytes of one participant's manifest (missing: not committed)."""
    path = participant_dir(checkpoint_dir, kind, instance) / MANIFEST_NAME
    try:
        return path, path.read_bytes()
    except FileNotFoundError:
        raise InvalidCheckpointState(f"missing manifest {path}: not committed") from None


def load_manifest(
    checkpoint_dir: str | os.PathLike[str],
    *,
    kind: str,
    instance: str,
    checkpoint_id: str | None,
    read: tuple[pathlib.Path, bytes] | None = None,
) -> ParticipantManifest:
    """The validated manifest of one participant (no records read).

    `read` is what `manifest_bytes` already returned, so a caller that hashed
    those bytes validates the same ones instead of reading the file again.
    """
    path, data = read or manifest_bytes(checkpoint_dir, kind, instance)
    manifest = decode_manifest(data, str(path))
    if (manifest.kind, manifest.instance) != (kind, instance):
        raise InvalidCheckpointState(
            f"manifest {path} is for {manifest.kind}/{manifest.instance}, not {kind}/{instance}"
        )
    if checkpoint_id is not None and manifest.checkpoint_id != checkpoint_id:
        raise InvalidCheckpointState(
            f"manifest {path} is for checkpoint {manifest.checkpoint_id!r}, not {checkpoint_id!r}"
        )
    return manifest


def _encode_records(writer: HashingWriter, records: Iterable[Record], stop: WriteStop) -> list[str]:
    encoder = StateEncoder()
    keys: list[str] = []
    buf = bytearray(MAGIC)
    for rec in records:
        stop.check()
        try:
            EpisodeId.from_capture_key(rec.key)
            encoder.append(buf, rec.key, rec.state)
        except (CheckpointError, TypeError, ValueError, OverflowError) as exc:
            raise InvalidCheckpointState(f"episode {rec.key}: cannot store state: {exc}") from exc
        keys.append(rec.key)
        if len(buf) >= CHUNK:
            writer.put(buf)
            buf = bytearray()
    writer.put(buf)
    if len(set(keys)) != len(keys):
        raise InvalidCheckpointState("records repeat a capture key")
    return keys


def write_participant(
    checkpoint_dir: str | os.PathLike[str],
    *,
    kind: str,
    instance: str,
    checkpoint_id: str,
    records: Iterable[Record],
    stop: WriteStop | None = None,
) -> ParticipantManifest:
    """Durably write the records, then create the manifest; return it.

    An identical recommit returns the existing manifest; a different commit
    into the same directory raises `InvalidCheckpointState`.
    """
    stop = stop or WriteStop()
    if not isinstance(checkpoint_id, str) or not checkpoint_id:
        raise InvalidCheckpointState(f"bad checkpoint id {checkpoint_id!r}")
    pdir = participant_dir(checkpoint_dir, kind, instance)
    stop.check()
    prior: ParticipantManifest | None = None
    with contextlib.suppress(InvalidCheckpointState):  # absent or unreadable: decided at link
        prior = load_manifest(checkpoint_dir, kind=kind, instance=instance, checkpoint_id=None)
    if prior is not None and prior.checkpoint_id != checkpoint_id:
        raise _conflict(pdir, prior)  # fail fast, before writing any records
    durable.ensure_dir(pdir)
    tmp = pdir / f".records.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        writer = HashingWriter(fd)
        try:
            keys = _encode_records(writer, records, stop)
        finally:
            digest = writer.close()
        durable.fsync_fd(fd, str(tmp))
    except BaseException:
        os.close(fd)
        durable.unlink_quietly(tmp)
        raise
    os.close(fd)
    manifest = ParticipantManifest(
        schema_version=SCHEMA_VERSION,
        checkpoint_id=checkpoint_id,
        kind=kind,
        instance=instance,
        records_file=f"records-{digest}.msgpack",
        digest_algo=DIGEST_ALGO,
        digest=digest,
        record_count=len(keys),
        episodes=sorted(keys),
        bytes=writer.size,
        format=FORMAT,
    )
    final = pdir / manifest.records_file
    try:
        with stop.publishing():
            placed = _place_records(tmp, final)
            durable.fsync_dir(pdir)
            existing = durable.create_never_replace(pdir / MANIFEST_NAME, encode_manifest(manifest))
    finally:
        durable.unlink_quietly(tmp)
    if existing is None:
        return manifest
    other = decode_manifest(existing, str(pdir / MANIFEST_NAME))
    if other == manifest:
        return other
    # Lost the manifest race.  Remove the records file only if this write
    # created it and the winner's manifest does not name it: the name is the
    # content digest, so another writer (a participant misconfigured with the
    # same kind and instance) may have committed the very same file.
    if placed and other.records_file != manifest.records_file:
        durable.unlink_quietly(final)
    raise _conflict(pdir, other)


def _place_records(tmp: pathlib.Path, final: pathlib.Path) -> bool:
    """Publish the fsynced temp file under its digest name; True if this call created it.

    A hard link is create-only: of two writers of the same bytes exactly one
    creates the name, and no writer ever replaces a file another may have
    named in its manifest.  Equal names mean equal bytes, so finding the name
    taken is success.
    """
    try:
        os.link(tmp, final)
    except FileExistsError:
        return False
    return True


def _conflict(pdir: pathlib.Path, other: ParticipantManifest) -> InvalidCheckpointState:
    return InvalidCheckpointState(
        f"{pdir} already holds a different commit (checkpoint {other.checkpoint_id!r}, "
        f"digest {other.digest[:12]}); a manifest is never replaced"
    )


def read_participant(
    checkpoint_dir: str | os.PathLike[str],
    *,
    kind: str,
    instance: str,
    checkpoint_id: str | None,
    select: Callable[[str], bool] | None = None,
) -> tuple[ParticipantManifest, list[Record]]:
    """Verify one participant's whole records file; return the records `select` keeps."""
    manifest = load_manifest(
        checkpoint_dir, kind=kind, instance=instance, checkpoint_id=checkpoint_id
    )
    return manifest, read_records(checkpoint_dir, manifest, select)


def read_records(
    checkpoint_dir: str | os.PathLike[str],
    manifest: ParticipantManifest,
    select: Callable[[str], bool] | None = None,
) -> list[Record]:
    """Verify the whole records file a loaded manifest names; the records `select` keeps."""
    pdir = participant_dir(checkpoint_dir, manifest.kind, manifest.instance)
    path = pdir / manifest.records_file
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise InvalidCheckpointState(f"records file {path} is missing") from None
    reader = HashingReader(fd)
    try:
        keys, kept, problem = _parse(reader, select)
        if problem is not None:
            reader.drain()
    finally:
        digest = reader.close()
        os.close(fd)
    if reader.size != manifest.bytes:
        raise InvalidCheckpointState(
            f"truncated or extended records {path}: {reader.size} bytes, manifest says "
            f"{manifest.bytes}"
        )
    if digest != manifest.digest:
        raise InvalidCheckpointState(f"digest mismatch in {path}: records are corrupt")
    if problem is not None:
        raise InvalidCheckpointState(f"corrupt records {path}: {problem}")
    if len(keys) != manifest.record_count or sorted(keys) != manifest.episodes:
        raise InvalidCheckpointState(
            f"records {path} hold {len(keys)} episodes, manifest lists {manifest.record_count}"
        )
    return kept


def _parse(
    reader: HashingReader, select: Callable[[str], bool] | None
) -> tuple[list[str], list[Record], str | None]:
    """Walk the frames; returns (keys, kept records, first problem or None)."""
    keys: list[str] = []
    kept: list[Record] = []
    buf = reader.read(len(MAGIC))
    if buf[: len(MAGIC)] != MAGIC:
        return keys, kept, "bad file header"
    pos = len(MAGIC)
    while True:
        if len(buf) - pos < FRAME.size:
            buf = buf[pos:] + reader.read(FRAME.size)
            pos = 0
            if not buf:
                return keys, kept, None
            if len(buf) < FRAME.size:
                return keys, kept, "truncated frame header"
        key_len, state_len = FRAME.unpack_from(buf, pos)
        need = FRAME.size + key_len + state_len
        if len(buf) - pos < need:
            buf = buf[pos:] + reader.read(need - (len(buf) - pos))
            pos = 0
            if len(buf) < need:
                return keys, kept, f"truncated record after {len(keys)} records"
        view = memoryview(buf)
        start = pos + FRAME.size
        try:
            key = bytes(view[start : start + key_len]).decode("utf-8")
            EpisodeId.from_capture_key(key)
        except (UnicodeDecodeError, CheckpointError):
            return keys, kept, f"bad capture key in record {len(keys)}"
        keys.append(key)
        if select is None or select(key):
            try:
                state = decode_state(view[start + key_len : pos + need])
            except (msgspec.DecodeError, ValueError) as exc:
                return keys, kept, f"record {key}: {exc}"
            kept.append(Record(key, state))
        pos += need
