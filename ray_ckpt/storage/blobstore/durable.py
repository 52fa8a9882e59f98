"""Durable file steps: temp file, write, fsync, rename or link, directory fsync.

The order matters (it is the one crash-consistency studies find most systems
get wrong): the data is fsynced before the name that publishes it appears,
and the directory is fsynced after, so a crash leaves either the old state or
the complete new one.  An fsync error aborts: after a failed fsync the kernel
may already have dropped the dirty pages, so retrying fsync on the same file
can report success for data that never reached the disk.  The temp file is
removed and the whole write must start again from a new one.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import threading
import uuid
from collections.abc import Iterable, Iterator

from ray_ckpt.errors import InvalidCheckpointState


class WriteStop:
    """Lets a resume stop a write: after `stop()` returns, it never publishes.

    Publication happens inside `publishing()`, under the same lock `stop()`
    takes, so `stop()` waits only for a publication already under way.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = False

    def stop(self) -> None:
        with self._lock:
            self._stopped = True

    @property
    def stopped(self) -> bool:
        return self._stopped

    def check(self) -> None:
        if self._stopped:
            raise InvalidCheckpointState("write stopped")

    @contextlib.contextmanager
    def publishing(self) -> Iterator[None]:
        with self._lock:
            self.check()
            yield


def fsync_fd(fd: int, what: str) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        raise InvalidCheckpointState(f"fsync of {what} failed ({exc}); write aborted") from exc


def fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fsync_fd(fd, f"directory {path}")
    finally:
        os.close(fd)


def ensure_dir(path: pathlib.Path) -> None:
    """Create `path` and any missing parents, fsyncing each new entry's parent."""
    ensure_dirs([path])


def ensure_dirs(paths: Iterable[pathlib.Path]) -> None:
    """`ensure_dir` for many paths at once: every missing folder is created,
    then each folder that gained an entry is fsynced once (siblings share
    their parent's fsync), all before this returns."""
    parents: set[pathlib.Path] = set()
    for path in paths:
        missing: list[pathlib.Path] = []
        p = path
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                continue
            parents.add(d.parent)
    for parent in sorted(parents, key=lambda d: (-len(d.parts), str(d))):
        fsync_dir(parent)


def unlink_quietly(path: pathlib.Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def write_new_file(tmp: pathlib.Path, data: bytes) -> None:
    """Write `data` to a new temp file and fsync it (raises if it exists)."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        fsync_fd(fd, str(tmp))
    except BaseException:
        os.close(fd)
        unlink_quietly(tmp)
        raise
    os.close(fd)


def create_never_replace(final: pathlib.Path, data: bytes) -> bytes | None:
    """Publish `data` at `final` unless a file is already there.

    Returns None when this call published, else the bytes already at `final`
    (the caller decides whether they are an identical recommit).  A hard link
    is atomic and fails if the name exists, so of two racing writers exactly
    one publishes; the directory is fsynced before returning.
    """
    # Unique per call: pid and thread id repeat across hosts sharing a file
    # system, and a writer must never unlink or reuse another writer's temp.
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
    write_new_file(tmp, data)
    existing: bytes | None = None
    try:
        os.link(tmp, final)
    except FileExistsError:
        existing = final.read_bytes()
    finally:
        unlink_quietly(tmp)
    # Also when another writer won: its directory fsync may still be pending.
    fsync_dir(final.parent)
    return existing
