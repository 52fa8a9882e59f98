"""`LocalBlobs`: a checkpoint root on a POSIX file system (local disk, NFS, Lustre).

Each `Blobs` guarantee is kept with the durable steps of `durable.py`:

- `create`: temp file, fsync, hard link to the final name (create-only: of
  two racing writers exactly one links), directory fsync;
- `upload`: the stream goes into a temp file (whole blocks around the page
  cache, `direct_io`); on a clean exit it is fsynced
  and hard-linked into place (a taken key raises), then the directory is
  fsynced (or, with `sync_name=False`, by the `create` that follows in the
  same folder); on an exception the temp file is removed and nothing appears;
- `replace`: temp file, fsync, rename over the old one, directory fsync;
- a reader never sees a partial object, because an object's name only ever
  appears for a complete, fsynced file.

Temp files are named by `blobs.temp_key`, so a crash leaves names that
`blobs.is_temp` recognises and garbage collection can remove.  OS errors are
mapped as `location.directory_errors` says (an unusable location is
`InvalidRequest`, a failing disk `ParticipantUnavailable`), so callers see the
same typed errors from every backend.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Callable, Iterator, Sequence

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage.blobstore import durable
from ray_ckpt.storage.blobstore.blobs import BlobInfo, BlobMissing, check_key, temp_key
from ray_ckpt.storage.blobstore.direct_io import StreamWriter
from ray_ckpt.storage.blobstore.location_errors import directory_errors

_READ_CHUNK = 4 << 20


class _FileUpload:
    def __init__(self, fd: int, url: str) -> None:
        self._url = url
        self._out = StreamWriter(fd)

    @property
    def size(self) -> int:
        return self._out.size

    def write(self, data: bytes | bytearray | memoryview) -> None:
        with directory_errors(self._url, "written"):
            self._out.write(data)

    def finish(self) -> None:
        with directory_errors(self._url, "written"):
            self._out.finish()

    def close(self) -> None:
        self._out.close()


class LocalBlobs:
    """A directory as a `Blobs`; keys are relative paths under `root`."""

    def __init__(self, root: pathlib.Path, url: str | None = None) -> None:
        if not root.is_absolute():
            raise ValueError(f"LocalBlobs needs an absolute root, got {root}")
        self.root = root
        self._url = url if url is not None else str(root)

    @property
    def url(self) -> str:
        return self._url

    def path(self, key: str) -> pathlib.Path:
        return self.root / check_key(key)

    def _errors(self, action: str) -> contextlib.AbstractContextManager[None]:
        return directory_errors(self._url, action)

    def read(self, key: str) -> bytes:
        with self._errors("read"):
            try:
                return self.path(key).read_bytes()
            except FileNotFoundError:
                raise BlobMissing(f"{self._where(key)} is missing") from None

    def stream(self, key: str) -> Iterator[bytes]:
        # Opened before the first chunk is asked for, so a missing key raises
        # at the call, not at the first `next`.
        return self._chunks(self._open(key))

    def read_range_into(self, key: str, start: int, buf: bytearray | memoryview) -> memoryview:
        view = memoryview(buf)
        got = 0
        fd = self._open(key)
        try:
            with self._errors("read"):
                while got < len(view) and (n := os.preadv(fd, [view[got:]], start + got)):
                    got += n
        finally:
            os.close(fd)
        return view[:got]

    def _open(self, key: str) -> int:
        with self._errors("read"):
            try:
                return os.open(self.path(key), os.O_RDONLY)
            except FileNotFoundError:
                raise BlobMissing(f"{self._where(key)} is missing") from None

    def _chunks(self, fd: int) -> Iterator[bytes]:
        try:
            with self._errors("read"):
                while data := os.read(fd, _READ_CHUNK):
                    yield data
        finally:
            os.close(fd)

    def create(self, key: str, data: bytes) -> bytes | None:
        with self._errors("written"):
            final = self.path(key)
            durable.ensure_dir(final.parent)
            return durable.create_never_replace(final, data)

    def replace(self, key: str, data: bytes) -> None:
        with self._errors("written"):
            final = self.path(key)
            durable.ensure_dir(final.parent)
            tmp = self.root / temp_key(key)
            durable.write_new_file(tmp, data)
            try:
                os.replace(tmp, final)
            except BaseException:
                durable.unlink_quietly(tmp)
                raise
            durable.fsync_dir(final.parent)

    @contextlib.contextmanager
    def upload(
        self,
        key: str,
        *,
        before_publish: Callable[[], object] | None = None,
        sync_name: bool = True,
    ) -> Iterator[_FileUpload]:
        with self._errors("written"):
            final = self.path(key)
            durable.ensure_dir(final.parent)
            tmp = self.root / temp_key(key)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                # Not under `_errors`: the caller's own exceptions pass as they are.
                up = _FileUpload(fd, self._url)
                try:
                    yield up
                    up.finish()
                finally:
                    up.close()
                durable.fsync_fd(fd, str(tmp))
            finally:
                os.close(fd)
            if before_publish is not None:
                before_publish()
            with self._errors("written"):
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    raise InvalidCheckpointState(f"{self._where(key)} already exists") from None
                if sync_name:
                    durable.fsync_dir(final.parent)
        finally:
            durable.unlink_quietly(tmp)

    def list(self, prefix: str = "") -> list[BlobInfo]:
        base = self.root / check_key(prefix.rstrip("/")) if prefix.strip("/") else self.root
        with self._errors("read"):
            if base.is_file():
                return [self._info(base)]
            found: list[BlobInfo] = []
            for dirpath, _dirs, files in os.walk(base):
                for name in files:
                    with contextlib.suppress(FileNotFoundError):  # removed while listing
                        found.append(self._info(pathlib.Path(dirpath, name)))
        return sorted(found, key=lambda info: info.key)

    def delete(self, keys: Sequence[str]) -> None:
        parents: set[pathlib.Path] = set()
        with self._errors("written"):
            for key in keys:
                path = self.path(key)
                durable.unlink_quietly(path)
                parents.add(path.parent)
            # One fsync per directory, not per file: the local form of a batch.
            for parent in sorted(parents):
                with contextlib.suppress(FileNotFoundError):
                    durable.fsync_dir(parent)

    def info(self, key: str) -> BlobInfo:
        path = self.path(key)
        with self._errors("read"):
            try:
                if not path.is_file():
                    raise FileNotFoundError(key)
                return self._info(path)
            except FileNotFoundError:
                raise BlobMissing(f"{self._where(key)} is missing") from None

    def exists(self, key: str) -> bool:
        with self._errors("read"):
            return self.path(key).is_file()

    def _info(self, path: pathlib.Path) -> BlobInfo:
        st = path.stat()
        key = path.relative_to(self.root).as_posix()
        return BlobInfo(key=key, size=st.st_size, modified=st.st_mtime)

    def _where(self, key: str) -> str:
        return f"{self._url.rstrip('/')}/{key}"
