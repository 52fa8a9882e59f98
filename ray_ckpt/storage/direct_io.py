"""Write a large file around the page cache (`O_DIRECT`), its tail through it.

A buffered write copies every byte into page-cache pages the kernel has to
find first.  On this project's VMs that is the slow and erratic part of a
commit: 360 MB written and fsynced took 0.15-0.26 s while the pages came
from recently freed memory and 0.6-1.3 s once they did not (the first touch
of each page traps to the hypervisor), so a commit's time depended on what
the machine did before it.  Written with `O_DIRECT` from one reused, aligned
buffer, the same bytes took 0.19-0.22 s every time, and a checkpoint no
longer pushes the Gym server's own pages out of the cache.

How: the stream is copied into a page-aligned block buffer; each full block
is written with `O_DIRECT` set on the descriptor (`fcntl`, so block-aligned
offsets are all it sees); the last partial block is written with the flag
cleared, through the page cache, so no padding or truncation is needed.  A
file smaller than one block never goes direct.  The caller's fsync still
gives durability (it also flushes the tail and the file's metadata).

Where the file system refuses `O_DIRECT` (tmpfs on older kernels, some FUSE
mounts), the flag or the first direct write fails with `EINVAL` and the
writer goes on buffered, starting each chunk's writeback as it is written
(`writeback`).  `RAY_CKPT_DIRECT_IO=0` turns it off.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os

from ray_ckpt.storage.writeback import start_writeback

BLOCK = 4 << 20  # a multiple of every logical block size (512 B to 4 KiB)
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def direct_io_enabled() -> bool:
    return _O_DIRECT != 0 and os.environ.get("RAY_CKPT_DIRECT_IO", "1") != "0"


def _set_direct(fd: int, on: bool) -> bool:
    """Set or clear O_DIRECT on `fd`; False where the file system refuses it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    want = flags | _O_DIRECT if on else flags & ~_O_DIRECT
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, want)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    return True


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


class StreamWriter:
    """Writes a stream of chunks to `fd` from offset 0; `finish` before the fsync."""

    def __init__(self, fd: int, *, direct: bool | None = None) -> None:
        self._fd = fd
        self.size = 0
        self._direct = direct_io_enabled() if direct is None else direct
        self._buf: mmap.mmap | None = None
        self._fill = 0
        self.direct_bytes = 0  # written around the page cache (for tests and figures)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        while view:
            if not self._direct:
                _write_all(self._fd, view)
                # The disk starts on this chunk while the next is encoded.
                start_writeback(self._fd, self.size - len(view), len(view))
                return
            if self._buf is None:
                self._buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
            n = min(len(view), BLOCK - self._fill)
            self._buf[self._fill : self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == BLOCK:
                self._write_block()

    def _write_block(self) -> None:
        assert self._buf is not None
        block = memoryview(self._buf)
        self._fill = 0
        offset = self.direct_bytes
        if _set_direct(self._fd, True):
            try:
                _write_all(self._fd, block)
                self.direct_bytes += BLOCK
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # Refused at the write: nothing was written (the offset stands).
                os.lseek(self._fd, offset, os.SEEK_SET)
        self._fall_back(block, offset)

    def _fall_back(self, block: memoryview, offset: int) -> None:
        """Buffered from here on, the block in hand first."""
        self._direct = False
        _set_direct(self._fd, False)
        _write_all(self._fd, block)
        start_writeback(self._fd, offset, len(block))

    def finish(self) -> None:
        """Write the partial last block (through the page cache) and free the buffer."""
        if self._buf is None:
            return
        if self._fill:
            _set_direct(self._fd, False)
            _write_all(self._fd, memoryview(self._buf)[: self._fill])
            self._fill = 0
        self.close()

    def close(self) -> None:
        """Free the buffer (a failed stream's, whose file is thrown away)."""
        buf, self._buf = self._buf, None
        if buf is not None:
            # A view of it may still live (a failed write's traceback): freed with it.
            with contextlib.suppress(BufferError):
                buf.close()
