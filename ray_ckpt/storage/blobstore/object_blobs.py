"""`ObjectBlobs`: a checkpoint root in an object store (`s3://`, `gs://`), through obstore.

Each `Blobs` guarantee maps onto the store's own atomic operations, as the
durable file steps do on disk:

- `create` (fsync + create-only hard link on disk) is one conditional PUT
  (`If-None-Match: *` on S3, `ifGenerationMatch=0` on GCS): of two writers
  exactly one creates the object, the other gets a precondition failure and
  reads what is there.  A PUT is atomic: the object appears whole or not;
- `upload` (temp file + fsync + link on disk) is a multipart upload for
  anything over one part: parts are sent while the caller still encodes, and
  only `CompleteMultipartUpload`, sent on a clean exit, makes the object
  visible, whole.  A failure aborts the upload; a crash leaves an incomplete
  upload that no read or listing sees (a bucket lifecycle rule for
  incomplete multipart uploads reclaims its parts).  obstore cannot make a
  multipart upload conditional (its create mode is single-PUT only, although
  S3 accepts `If-None-Match` on `CompleteMultipartUpload`), so a large upload
  is create-only only as far as a HEAD before it shows: callers give it a
  fresh random key, which no other writer can hold.  An upload that stays
  within one part is sent as a conditional PUT, create-only for real;
- `replace` (temp + rename on disk) is a plain PUT, atomic on the store;
- `delete` is the store's batch delete (1000 keys a request on S3).

Credentials, region and endpoint come from obstore's usual sources (the
environment: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
`AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`, `GOOGLE_SERVICE_ACCOUNT`, ...; instance
and web-identity credentials).  None is ever put in a message: `url` is the
location as the user wrote it, and a store error is reported by its kind and
first line (the request's URL, never its signature).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    InvalidPathError,
    NotSupportedError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
    UnknownConfigurationKeyError,
)

from ray_ckpt.errors import (
    CheckpointError,
    InvalidCheckpointState,
    InvalidRequest,
    ParticipantUnavailable,
)
from ray_ckpt.storage.blobstore.blobs import BlobInfo, BlobMissing, check_key

PART = 8 << 20  # multipart part size (S3's minimum is 5 MiB)
_CONCURRENCY = 4  # parts in flight per upload
_READ_CHUNK = 4 << 20
_DEPTH = 4  # chunks queued between the writer and the uploading thread
_DELETE_BATCH = 1000
_UNUSABLE = (
    PermissionDeniedError,
    UnauthenticatedError,
    PermissionError,
    InvalidPathError,
    NotSupportedError,
    UnknownConfigurationKeyError,
    ValueError,
)


def store_error(url: str, action: str, exc: BaseException) -> CheckpointError:
    """The typed error for a store failure: unusable location (400) or transient (503)."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    detail = f"checkpoint location {url!r} cannot be {action}: {type(exc).__name__}: {first}"
    if isinstance(exc, _UNUSABLE):
        return InvalidRequest(detail)
    if isinstance(exc, FileNotFoundError):  # a write into a bucket that is not there
        return InvalidRequest(detail)
    return ParticipantUnavailable(detail)


class ObjectBlobs:
    """An object-store prefix as a `Blobs`; `store` is obstore's, rooted at the prefix."""

    def __init__(self, url: str, store: Any) -> None:
        self._url = url
        self._store = store

    @property
    def url(self) -> str:
        return self._url

    def _where(self, key: str) -> str:
        return f"{self._url.rstrip('/')}/{key}"

    @contextlib.contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except CheckpointError:
            raise
        except Exception as exc:
            raise store_error(self._url, action, exc) from exc

    def read(self, key: str) -> bytes:
        with self._errors("read"):
            try:
                return bytes(obstore.get(self._store, check_key(key)).bytes())
            except FileNotFoundError:
                raise BlobMissing(f"{self._where(key)} is missing") from None

    def stream(self, key: str) -> Iterator[bytes]:
        with self._errors("read"):
            try:
                result = obstore.get(self._store, check_key(key))
            except FileNotFoundError:
                raise BlobMissing(f"{self._where(key)} is missing") from None
        return self._chunks(result)

    def read_range_into(self, key: str, start: int, buf: bytearray | memoryview) -> memoryview:
        with self._errors("read"):
            try:
                got = obstore.get_range(self._store, check_key(key), start=start, length=len(buf))
            except FileNotFoundError:
                raise BlobMissing(f"{self._where(key)} is missing") from None
            view, n = memoryview(buf), len(got)
            view[:n] = memoryview(got)
        return view[:n]

    def _chunks(self, result: Any) -> Iterator[bytes]:
        with self._errors("read"):
            for chunk in result.stream(min_chunk_size=_READ_CHUNK):
                yield bytes(chunk)

    def create(self, key: str, data: bytes) -> bytes | None:
        with self._errors("written"):
            try:
                obstore.put(self._store, check_key(key), data, mode="create", use_multipart=False)
            except (AlreadyExistsError, PreconditionError):
                return self.read(key)
        return None

    def replace(self, key: str, data: bytes) -> None:
        with self._errors("written"):
            obstore.put(self._store, check_key(key), data, use_multipart=False)

    @contextlib.contextmanager
    def upload(
        self,
        key: str,
        *,
        before_publish: Callable[[], object] | None = None,
        sync_name: bool = True,  # a completed upload is durable: nothing to defer
    ) -> Iterator[_StreamUpload]:
        if self.exists(key):
            raise InvalidCheckpointState(f"{self._where(key)} already exists")
        up = _StreamUpload(self, check_key(key))
        try:
            yield up
            if before_publish is not None:
                before_publish()
        except BaseException:
            up.abort()
            raise
        up.finish()

    def list(self, prefix: str = "") -> list[BlobInfo]:
        base = prefix.strip("/")
        with self._errors("read"):
            found = [
                BlobInfo(key=m["path"], size=m["size"], modified=m["last_modified"].timestamp())
                for batch in obstore.list(self._store, prefix=check_key(base) if base else None)
                for m in batch
            ]
        return sorted(found, key=lambda info: info.key)

    def delete(self, keys: Sequence[str]) -> None:
        todo = [check_key(k) for k in keys]
        with self._errors("written"):
            for i in range(0, len(todo), _DELETE_BATCH):
                batch = todo[i : i + _DELETE_BATCH]
                try:
                    obstore.delete(self._store, batch)
                except FileNotFoundError:
                    # Stores without a batch delete may stop at a key already
                    # gone: go one by one, and gone is fine.
                    for k in batch:
                        with contextlib.suppress(FileNotFoundError):
                            obstore.delete(self._store, k)

    def info(self, key: str) -> BlobInfo:
        with self._errors("read"):
            try:
                meta = obstore.head(self._store, check_key(key))
            except FileNotFoundError:
                raise BlobMissing(f"{self._where(key)} is missing") from None
        return BlobInfo(key=key, size=meta["size"], modified=meta["last_modified"].timestamp())

    def exists(self, key: str) -> bool:
        try:
            self.info(key)
        except BlobMissing:
            return False
        return True


_END = object()
_ABORT = object()


class _Aborted(Exception):
    """Raised into obstore's reading of the stream so it aborts the upload."""


class _StreamUpload:
    """Bytes buffered up to one part; beyond that, a multipart upload on a thread.

    The thread runs obstore's `put` over a queue, so parts go up while the
    writer encodes the next chunk.  The upload completes only when the queue
    says the end; an abort makes the stream raise, and obstore aborts."""

    def __init__(self, blobs: ObjectBlobs, key: str) -> None:
        self._blobs = blobs
        self._key = key
        self._head: list[bytes] = []
        self._held = 0
        self._queue: queue.Queue[object] = queue.Queue(maxsize=_DEPTH)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        chunk = bytes(data)  # the caller may reuse its buffer
        if self._thread is None:
            self._head.append(chunk)
            self._held += len(chunk)
            if self._held > PART:
                self._start()
            return
        self._send(chunk)

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ray-ckpt-upload", daemon=True)
        self._thread.start()
        head, self._head = self._head, []
        for chunk in head:
            self._send(chunk)

    def _items(self) -> Iterator[bytes]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if item is _ABORT:
                raise _Aborted("upload aborted")
            assert isinstance(item, bytes)
            yield item

    def _run(self) -> None:
        try:
            obstore.put(
                self._blobs._store,
                self._key,
                self._items(),
                chunk_size=PART,
                max_concurrency=_CONCURRENCY,
            )
        except BaseException as exc:
            self._error = exc

    def _send(self, item: object) -> None:
        assert self._thread is not None
        while True:
            self._raise_error()
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _raise_error(self) -> None:
        if self._error is not None:
            raise store_error(self._blobs.url, "written", self._error) from self._error
        if self._thread is not None and not self._thread.is_alive():
            raise ParticipantUnavailable(f"upload to {self._blobs.url!r} stopped")

    def finish(self) -> None:
        if self._thread is None:
            with self._blobs._errors("written"):
                try:
                    obstore.put(
                        self._blobs._store,
                        self._key,
                        b"".join(self._head),
                        mode="create",
                        use_multipart=False,
                    )
                except (AlreadyExistsError, PreconditionError):
                    raise InvalidCheckpointState(
                        f"{self._blobs._where(self._key)} already exists"
                    ) from None
            return
        self._send(_END)
        self._thread.join()
        if self._error is not None:
            raise store_error(self._blobs.url, "written", self._error) from self._error

    def abort(self) -> None:
        if self._thread is None:
            return
        while self._thread.is_alive():
            with contextlib.suppress(queue.Full):
                self._queue.put(_ABORT, timeout=0.1)
                break
        self._thread.join()
