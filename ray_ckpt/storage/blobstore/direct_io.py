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
offsets are all it sees), on a thread while the next block fills; the last
partial block is written with the flag cleared, through the page cache, so
no padding or truncation is needed.  A
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
from concurrent.futures import Future, ThreadPoolExecutor

from ray_ckpt.storage.blobstore.writeback import start_writeback

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


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class StreamWriter:
    """Writes a stream of chunks to `fd` from offset 0; `finish` before the fsync.

    Two block buffers: while one is written (on a thread of its own, so the
    disk never waits for the writer to be scheduled again, as it would on a
    busy machine), the next is filled.  `close` waits for a write in flight
    before the caller may close `fd`."""

    def __init__(self, fd: int, *, direct: bool | None = None) -> None:
        self._fd = fd
        self.size = 0
        self._direct = direct_io_enabled() if direct is None else direct
        self._flag_set = False
        self._free: list[mmap.mmap] = []
        self._buf: mmap.mmap | None = None  # being filled
        self._fill = 0
        self._offset = 0  # the file offset of the block being filled
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[Future[None], mmap.mmap, int] | None = None
        self.direct_bytes = 0  # written around the page cache (for tests and figures)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        pos = self.size  # the file offset of view[0]
        self.size += len(view)
        while view:
            if not self._direct:
                _pwrite_all(self._fd, view, pos)
                # The disk starts on this chunk while the next is encoded.
                start_writeback(self._fd, pos, len(view))
                return
            if self._buf is None:
                # Page-aligned, as O_DIRECT needs; at most two ever exist.
                self._buf = self._free.pop() if self._free else mmap.mmap(-1, BLOCK)
            n = min(len(view), BLOCK - self._fill)
            self._buf[self._fill : self._fill + n] = view[:n]
            self._fill += n
            view, pos = view[n:], pos + n
            if self._fill == BLOCK:
                self._submit()

    def _submit(self) -> None:
        """Start writing the full block; wait for the one before it first."""
        buf, offset = self._buf, self._offset
        assert buf is not None
        self._buf, self._fill, self._offset = None, 0, offset + BLOCK
        self._settle()
        if self._direct and not self._flag_set:
            self._flag_set = _set_direct(self._fd, True)
            self._direct = self._flag_set
        if not self._direct:
            self._buffered(buf, offset)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ray-ckpt-direct")
        future = self._pool.submit(_pwrite_all, self._fd, memoryview(buf), offset)
        self._pending = (future, buf, offset)

    def _settle(self) -> None:
        """Wait for the write in flight; where O_DIRECT is refused at the write
        (EINVAL: nothing was written), write that block buffered instead."""
        if self._pending is None:
            return
        future, buf, offset = self._pending
        self._pending = None
        try:
            future.result()
            self.direct_bytes += BLOCK
            self._free.append(buf)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._buffered(buf, offset)

    def _clear_direct(self) -> None:
        if self._flag_set:
            _set_direct(self._fd, False)
            self._flag_set = False

    def _buffered(self, buf: mmap.mmap, offset: int) -> None:
        """Write a block through the page cache, and every byte after it."""
        self._clear_direct()
        self._direct = False
        _pwrite_all(self._fd, memoryview(buf), offset)
        start_writeback(self._fd, offset, BLOCK)
        self._free.append(buf)

    def finish(self) -> None:
        """Wait for the last block's write, write the partial last block
        through the page cache, free the buffers."""
        self._settle()
        if self._buf is not None and self._fill:
            self._clear_direct()
            _pwrite_all(self._fd, memoryview(self._buf)[: self._fill], self._offset)
            self._fill = 0
        self.close()

    def close(self) -> None:
        """Wait for a write in flight (its error is the failed stream's own
        business), then free the buffers and the thread."""
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self._pending[0].result()
            self._free.append(self._pending[1])
            self._pending = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        buffers = [*self._free, *([self._buf] if self._buf is not None else [])]
        self._free, self._buf = [], None
        for buf in buffers:
            # A view of it may still live (a failed write's traceback): freed with it.
            with contextlib.suppress(BufferError):
                buf.close()
