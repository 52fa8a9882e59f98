"""The local content store: each distinct content once, named by its digest.

`<dir>/<digest>` holds exactly the bytes whose BLAKE3 hex digest is its
name, read-only and never changed in place: a capture hands these paths out
as its attachments, and they stay valid until no sandbox holds them.  A file
enters by being copied while it is hashed (the digest is of the bytes
copied, whatever the source did meanwhile), under a temporary name, then
linked to its digest's name unless that content is stored already.

The store counts, per digest, the sandboxes holding it; `sweep` deletes the
ones nobody holds.  It is synchronous and keeps no lock: its owner calls
`sweep` only when no copy into it is under way (`DirectorySandbox`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import uuid
from collections.abc import Iterable

import blake3

from ray_ckpt.errors import SandboxFileTooLarge, SandboxSpecialFile

CHUNK = 1 << 20  # per read: large enough to amortise the calls, small enough to stay in cache


def new_buffer() -> bytearray:
    """A copy buffer: one per thread of copies, reused file after file."""
    return bytearray(CHUNK)


def open_regular(path: str, *, what: str) -> int:
    """A read descriptor on `path`, which must be a regular file (not a
    symlink: O_NOFOLLOW; a FIFO is opened without blocking, then refused)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise SandboxSpecialFile(f"{what} is not a regular file")
    return fd


def copy_hashing(src: int, dst: int, buf: bytearray, *, limit: int, what: str) -> tuple[str, int]:
    """Copy `src` to `dst` (descriptors) while hashing it; (digest, bytes).
    More than `limit` bytes: `SandboxFileTooLarge` (the copy is partial)."""
    hasher = blake3.blake3()
    view = memoryview(buf)
    total = 0
    while n := os.readv(src, [view]):
        total += n
        if total > limit:
            raise SandboxFileTooLarge(f"{what} is over the sandbox's bound of {limit} bytes")
        chunk = view[:n]
        hasher.update(chunk)
        while chunk:
            chunk = chunk[os.write(dst, chunk) :]
    return hasher.hexdigest(), total


class ContentStore:
    """`<directory>/<digest>` files, counted by holder (see the module docstring)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._holders: dict[str, int] = {}

    def adopt(self) -> None:
        """Start empty: whatever a dead process left here is nobody's."""
        shutil.rmtree(self.directory, ignore_errors=True)
        os.makedirs(self.directory, exist_ok=True)

    def path(self, digest: str) -> str:
        return os.path.join(self.directory, digest)

    def known(self) -> frozenset[str]:
        """The digests stored now (a copy: a thread of copies reads it while
        the owner's loop goes on)."""
        return frozenset(self._holders)

    def put(self, src: int, buf: bytearray, *, limit: int, what: str) -> tuple[str, int, bool]:
        """Copy the file open at `src` in; (digest, bytes, whether this call
        stored that content: False when it was there already).

        Thread-safe against other `put`s.  A content it stores counts no
        holder until `hold`: the owner holds it, or `sweep` deletes it."""
        tmp = os.path.join(self.directory, f".put-{uuid.uuid4().hex}")
        try:
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
            try:
                digest, size = copy_hashing(src, out, buf, limit=limit, what=what)
            finally:
                os.close(out)
            try:
                os.link(tmp, self.path(digest))  # never replaces a stored file
                created = True
            except FileExistsError:
                created = False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return digest, size, created

    def stored(self, digests: Iterable[str]) -> None:
        """Digests `put` stored (holders 0 until held), so `sweep` knows of
        them even if the copy that made them then failed."""
        for d in digests:
            self._holders.setdefault(d, 0)

    def hold(self, digests: Iterable[str]) -> None:
        for d in digests:
            self._holders[d] = self._holders.get(d, 0) + 1

    def release(self, digests: Iterable[str]) -> None:
        for d in digests:
            self._holders[d] -= 1

    def sweep(self) -> int:
        """Delete every stored content no holder holds; how many went."""
        doomed = [d for d, n in self._holders.items() if n <= 0]
        for d in doomed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(d))
            del self._holders[d]
        return len(doomed)
