"""Attachments: the content-addressed files a record's state names, stored as blob objects.

A record may name files beside its state (`Record.attachments`: BLAKE3 hex
digest -> a local path holding exactly those bytes; a sandbox's snapshot).
Each distinct digest over a participant's records is stored once, as its own
object ``gym/<kind>/<instance>/blobs/<digest>``, never inside the records
file (whose format does not change).  The manifest lists them
(`ParticipantManifest.attachments`, `.blobs`) and is still created last, so
a blob no manifest names is only garbage, collected with its checkpoint.

Writing (`store_blobs`): each source is streamed, hashed as it goes, into an
`upload` that publishes the object only once the digest matched, so a
source that is not what its digest says never appears under that name and
the write fails (`InvalidCheckpointState`), before the manifest.  On disk
each blob's data is fsynced like the records, and their names are made
durable by one fsync of the ``blobs`` folder once all are stored
(`sync_names`).  A digest already stored in this checkpoint with the
source's size is kept (a retried commit; the name is the content); one an
incremental base holds is referenced instead (`incremental.plan`: the
reference names the checkpoint holding the object, flattened).

Reading (`attach`): only the blobs of the records a restore keeps.  On a
local disk the path handed back is the blob object itself, once its size and
digest are verified (the caller must not change it); from an object store
each blob is downloaded, hashed on the way, into a folder the caller gives
(or a fresh temporary one, which the caller then owns and removes).  Any blob
missing, resized or corrupt fails the read whole: no record is returned and
the files this read downloaded are removed.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

import blake3
import msgspec

from ray_ckpt.errors import InvalidCheckpointState, ParticipantUnavailable
from ray_ckpt.storage.blobstore import durable
from ray_ckpt.storage.blobstore.blobs import BlobMissing, Blobs, blob_name
from ray_ckpt.storage.blobstore.durable import WriteStop
from ray_ckpt.storage.blobstore.local_blobs import LocalBlobs
from ray_ckpt.storage.blobstore.location_errors import directory_errors
from ray_ckpt.storage.participant.incremental import root_of
from ray_ckpt.storage.participant.participant_manifest import (
    BLOBS,
    DIGEST_RE,
    BlobRef,
    ParticipantManifest,
    blob_key,
    check_name,
    participant_key,
)
from ray_ckpt.storage.records.record import Record

_CHUNK = 4 << 20
# Blobs written or fetched side by side: on a store each is a round trip or
# more (a sandbox has many small files); blake3 and file I/O release the GIL.
_WORKERS = 4


class Collected:
    """The attachments of the records a write reads, checked as it reads them.

    `reading` passes the records through unchanged (a capture's audit still
    runs as the encoder reads each one), noting each record's digests and one
    source path per digest."""

    def __init__(self) -> None:
        self.by_record: dict[str, list[str]] = {}
        self.sources: dict[str, str] = {}

    def reading(self, records: Iterable[Record]) -> Iterator[Record]:
        for record in records:
            self.add(record)
            yield record

    def add(self, record: Record) -> None:
        found = record.attachments
        if not found:
            return
        if not isinstance(found, Mapping):
            raise InvalidCheckpointState(
                f"episode {record.key}: attachments must map digests to paths"
            )
        for digest, path in found.items():
            if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
                raise InvalidCheckpointState(
                    f"episode {record.key}: attachment {digest!r} is not a BLAKE3 hex digest"
                )
            try:
                source = os.fspath(path)
            except TypeError:
                source = ""
            if not isinstance(source, str) or not source:
                raise InvalidCheckpointState(
                    f"episode {record.key}: attachment {digest} names no local path ({path!r})"
                )
            self.sources.setdefault(digest, source)
        self.by_record[record.key] = sorted(found)


def by_record(records: Iterable[Record]) -> dict[str, list[str]]:
    """Each record's digests, sorted, for the records that have some."""
    collected = Collected()
    for record in records:
        collected.add(record)
    return collected.by_record


# --- writing ------------------------------------------------------------------


def store_blobs(
    blobs: Blobs,
    pkey: str,
    *,
    checkpoint_id: str,
    sources: Mapping[str, str],
    refs: Mapping[str, BlobRef],
    stop: WriteStop,
) -> list[BlobRef]:
    """Store each digest of `sources` not in `refs` as this checkpoint's own
    object; every digest's `BlobRef`, sorted by digest.  Raises
    `InvalidCheckpointState` for a source that does not match its digest (its
    object never appears) or that cannot be read."""
    own = {d: p for d, p in sources.items() if d not in refs}
    out = [refs[d] for d in sources if d in refs]
    if own:
        check_name("checkpoint", checkpoint_id)  # own blobs are listed under it
        folder = f"{pkey}/{BLOBS}"
        present = {i.key: i.size for i in blobs.list(folder)}
        todo: list[str] = []
        for digest in sorted(own):
            size = present.get(blob_key(pkey, digest))
            if size is None:
                todo.append(digest)
                continue
            # Stored before (a retried commit): the name is the content.
            _check_existing(blobs, blob_key(pkey, digest), size, _source_size(own[digest]))
            out.append(BlobRef(checkpoint_id, digest, size))
        out += _put_all(blobs, pkey, checkpoint_id, todo, own, stop)
        sync_names(blobs, folder)
    return sorted(out, key=lambda r: r.digest)


class _Cancelled(InvalidCheckpointState):
    """A blob write given up because another one failed (that one is raised)."""


def _put_all(
    blobs: Blobs,
    pkey: str,
    checkpoint_id: str,
    todo: list[str],
    sources: Mapping[str, str],
    stop: WriteStop,
) -> list[BlobRef]:
    """Every blob of `todo`, side by side, each one's data durable but not its
    name yet; the caller's `sync_names` makes all the names durable at once."""
    if not todo:
        return []
    failed = threading.Event()

    def check() -> None:
        stop.check()
        if failed.is_set():
            raise _Cancelled("given up: another attachment failed")

    def put(digest: str) -> BlobRef:
        try:
            size = _put(blobs, blob_key(pkey, digest), digest, sources[digest], check)
        except BaseException:
            failed.set()
            raise
        return BlobRef(checkpoint_id, digest, size)

    with ThreadPoolExecutor(_WORKERS, thread_name_prefix="ray-ckpt-blobs") as pool:
        futures = [pool.submit(put, d) for d in todo]
        errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, _Cancelled)), errors[0])
    return [f.result() for f in futures]


def sync_names(blobs: Blobs, folder: str) -> None:
    """On disk, one fsync of the ``blobs`` folder makes every name in it
    durable: those just written and those an earlier attempt wrote (a failed
    write stores some blobs and never syncs their names; its retry finds them
    there).  A store's completed upload is durable by itself."""
    if isinstance(blobs, LocalBlobs):
        path = blobs.path(folder)
        with directory_errors(blobs.url, "written"):
            durable.fsync_dir(path)


def _put(blobs: Blobs, key: str, digest: str, path: str, check: Callable[[], None]) -> int:
    """Stream `path` into the object `key`, published only if it hashes to `digest`."""
    hasher = blake3.blake3()
    size = 0
    mismatch = False

    def verify() -> None:
        nonlocal mismatch
        got = hasher.hexdigest()
        if got != digest:
            mismatch = True
            raise InvalidCheckpointState(
                f"attachment {path} does not match its digest {digest} "
                f"({size} bytes hash to {got}): nothing published"
            )

    src = _open(path)
    try:
        try:
            with blobs.upload(key, before_publish=verify, sync_name=False) as up:
                while chunk := _read(src, path):
                    check()
                    hasher.update(chunk)
                    up.write(chunk)
                    size += len(chunk)
        except InvalidCheckpointState:
            # Another writer published the same name first: content-addressed,
            # so the same size is the same object.
            if mismatch or not _exists_with(blobs, key, os.fstat(src.fileno()).st_size):
                raise
            return blobs.info(key).size
    finally:
        src.close()
    return size


def _open(path: str) -> io.FileIO:
    try:
        return io.FileIO(path, "rb")
    except OSError as exc:
        raise InvalidCheckpointState(f"attachment {path} cannot be read: {exc}") from exc


def _read(src: io.FileIO, path: str) -> bytes:
    try:
        return src.read(_CHUNK) or b""
    except OSError as exc:
        raise InvalidCheckpointState(f"attachment {path} cannot be read: {exc}") from exc


def _source_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError as exc:
        raise InvalidCheckpointState(f"attachment {path} cannot be read: {exc}") from exc


def _exists_with(blobs: Blobs, key: str, size: int) -> bool:
    try:
        return blobs.info(key).size == size
    except BlobMissing:
        return False


def _check_existing(blobs: Blobs, key: str, size: int, source_size: int) -> None:
    if size != source_size:
        raise InvalidCheckpointState(
            f"{blob_name(blobs, key)} already holds {size} bytes, its attachment "
            f"{source_size}: a blob is never replaced"
        )


# --- reading ------------------------------------------------------------------


def attach(
    here: Blobs,
    manifest: ParticipantManifest,
    records: list[Record],
    attachments_dir: str | None,
) -> list[Record]:
    """`records` with their attachments, each a verified local file (see the
    module's docstring); nothing if any blob fails."""
    wanted = sorted({d for r in records for d in manifest.attachments.get(r.key, ())})
    if not wanted:
        return records
    refs = {b.digest: b for b in manifest.blobs}
    pkey = participant_key(manifest.kind, manifest.instance)
    root = root_of(here) if any(not manifest.own_blob(refs[d]) for d in wanted) else here
    places = {d: _place(here, root, manifest, pkey, refs[d]) for d in wanted}
    download = any(not isinstance(holder, LocalBlobs) for holder, _key in places.values())
    made = download and attachments_dir is None
    target = attachments_dir
    if made:
        with _folder_errors(tempfile.gettempdir()):
            target = tempfile.mkdtemp(prefix="ray-ckpt-attachments-")
    fetched: list[pathlib.Path] = []
    try:
        with ThreadPoolExecutor(_WORKERS, thread_name_prefix="ray-ckpt-blobs") as pool:
            futures = {
                d: pool.submit(_local, holder, key, refs[d], target, fetched)
                for d, (holder, key) in places.items()
            }
            errors = [f.exception() for f in futures.values()]
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error
        paths = {d: f.result() for d, f in futures.items()}
    except BaseException:
        # All or nothing: what this read downloaded goes with it.
        for path in fetched:
            with contextlib.suppress(OSError):
                path.unlink()
        if made and target is not None:
            shutil.rmtree(target, ignore_errors=True)
        raise
    return [
        msgspec.structs.replace(r, attachments={d: paths[d] for d in manifest.attachments[r.key]})
        if r.key in manifest.attachments
        else r
        for r in records
    ]


def _place(
    here: Blobs, root: Blobs, manifest: ParticipantManifest, pkey: str, ref: BlobRef
) -> tuple[Blobs, str]:
    """The store holding `ref`'s object and its key there."""
    if manifest.own_blob(ref):
        return here, blob_key(pkey, ref.digest)
    return root, f"{ref.checkpoint}/{blob_key(pkey, ref.digest)}"


def _local(
    holder: Blobs, key: str, ref: BlobRef, target: str | None, fetched: list[pathlib.Path]
) -> str:
    """A verified local file holding `ref`'s bytes: the object itself on disk,
    else a download into `target`."""
    if isinstance(holder, LocalBlobs):
        _verify(holder, key, ref, None)
        return str(holder.path(key))
    assert target is not None
    final = pathlib.Path(target, ref.digest)
    tmp = final.with_name(f".{ref.digest}.{uuid.uuid4().hex}.tmp")
    try:
        with _folder_errors(target):
            out = open(tmp, "wb")  # noqa: SIM115 (closed below, before the rename)
        try:
            _verify(holder, key, ref, out)
        finally:
            out.close()
        with _folder_errors(target):
            os.replace(tmp, final)
        fetched.append(final)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return str(final)


@contextlib.contextmanager
def _folder_errors(target: str) -> Iterator[None]:
    """The download folder is the restoring host's own disk, not the
    checkpoint: a failure there (full, gone) may heal, and says so."""
    try:
        yield
    except OSError as exc:
        raise ParticipantUnavailable(
            f"attachments folder {target!r} cannot be written: {exc}"
        ) from exc


def _verify(holder: Blobs, key: str, ref: BlobRef, out: BinaryIO | None) -> None:
    """Stream the object through BLAKE3 (and into `out`); raise unless it has
    the size and digest `ref` records."""
    name = blob_name(holder, key)
    try:
        chunks = holder.stream(key)
    except BlobMissing:
        raise InvalidCheckpointState(f"attachment blob {name} is missing") from None
    hasher = blake3.blake3()
    size = 0
    with contextlib.closing(_Closing(chunks)):
        for chunk in chunks:
            hasher.update(chunk)
            size += len(chunk)
            if size > ref.bytes:
                break  # longer than recorded: no need to read the rest
            if out is not None:
                with _folder_errors(os.path.dirname(out.name)):
                    out.write(chunk)
    if size != ref.bytes:
        raise InvalidCheckpointState(
            f"truncated or extended attachment blob {name}: manifest says {ref.bytes} bytes"
        )
    if hasher.hexdigest() != ref.digest:
        raise InvalidCheckpointState(f"digest mismatch in attachment blob {name}: it is corrupt")


class _Closing:
    """Closes a stream left before its end (a generator holds a file or a
    response open until then)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()


def verify_blobs(here: Blobs, manifest: ParticipantManifest) -> None:
    """Every blob the manifest lists, own and referenced, has its size and
    digest (read and hashed, nothing kept): for a checkpoint's verify."""
    if not manifest.blobs:
        return
    pkey = participant_key(manifest.kind, manifest.instance)
    foreign = any(not manifest.own_blob(b) for b in manifest.blobs)
    root = root_of(here) if foreign else here
    with ThreadPoolExecutor(_WORKERS, thread_name_prefix="ray-ckpt-blobs") as pool:
        futures = [
            pool.submit(_verify, *_place(here, root, manifest, pkey, ref), ref, None)
            for ref in manifest.blobs
        ]
        errors = [f.exception() for f in futures]
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error


# --- what a checkpoint needs ---------------------------------------------------


def blob_needs(name: str, pdir: str, m: Mapping[str, Any]) -> set[str]:
    """The blob keys a raw participant manifest of checkpoint `name` needs
    (`pdir` its folder under the checkpoint, ``gym/<kind>/<instance>``).

    Lenient like `incremental.referenced_files`: garbage collection asks it
    what to keep, so an entry it cannot read is skipped rather than failing
    the scan (the restore of that checkpoint refuses it, naming what is wrong)."""
    found: set[str] = set()
    listed = m.get("blobs")
    own = m.get("checkpoint_id")
    for ref in listed if isinstance(listed, list) else ():
        if not isinstance(ref, list) or len(ref) < 2:
            continue
        checkpoint, digest = ref[0], ref[1]
        if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
            continue
        if checkpoint == own:
            found.add(f"{name}/{pdir}/{BLOBS}/{digest}")
        elif _plain(checkpoint):
            found.add(f"{checkpoint}/{pdir}/{BLOBS}/{digest}")
    return found


def _plain(checkpoint: object) -> bool:
    if not isinstance(checkpoint, str):
        return False
    try:
        check_name("checkpoint", checkpoint)
    except InvalidCheckpointState:
        return False
    return True


def own_blob_bytes(m: Mapping[str, Any]) -> int:
    """A raw manifest's `blob_bytes` (0 when absent or unreadable)."""
    n = m.get("blob_bytes")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else 0
