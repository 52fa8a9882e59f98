"""Chunk pipelines: hash and write (or hash) on threads while the caller works.

hashlib and os.write release the GIL for large buffers, so a chunk can be
hashed on one thread and written on another while the caller encodes (or
decodes) the next; bounded queues keep memory to a few chunks.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Callable

CHUNK = 4 << 20
_DEPTH = 4

Chunk = bytes | bytearray


class _Worker:
    """One thread applying `fn` to each queued chunk in order."""

    def __init__(self, fn: Callable[[Chunk], None], name: str) -> None:
        self._fn = fn
        self._queue: queue.Queue[Chunk | None] = queue.Queue(maxsize=_DEPTH)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.error is not None:
                continue  # keep draining so the producer never blocks forever
            try:
                self._fn(item)
            except BaseException as exc:
                self.error = exc

    def put(self, item: Chunk) -> None:
        self._queue.put(item)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


def _write_all(fd: int, data: Chunk) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class HashingWriter:
    """Write chunks to `fd` and sha256 them, on two threads."""

    def __init__(self, fd: int) -> None:
        self._hash = hashlib.sha256()
        self.size = 0
        self._workers = [
            _Worker(self._hash.update, "ray-ckpt-hash"),
            _Worker(lambda chunk: _write_all(fd, chunk), "ray-ckpt-write"),
        ]

    def put(self, chunk: Chunk) -> None:
        for w in self._workers:
            if w.error is not None:
                raise w.error
        self.size += len(chunk)
        for w in self._workers:
            w.put(chunk)

    def close(self) -> str:
        """Wait for every chunk; return the hex digest (raises a worker's error)."""
        for w in self._workers:
            w.close()
        for w in self._workers:
            if w.error is not None:
                raise w.error
        return self._hash.hexdigest()


class HashingReader:
    """Read a file in chunks, hashing each on a thread as it is handed out."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._hash = hashlib.sha256()
        self._worker = _Worker(self._hash.update, "ray-ckpt-hash")
        self.size = 0

    def read(self, want: int) -> bytes:
        """At least `want` bytes unless the file ends first (b"" at EOF)."""
        parts: list[bytes] = []
        got = 0
        while got < want:
            data = os.read(self._fd, max(CHUNK, want - got))
            if not data:
                break
            self._worker.put(data)
            self.size += len(data)
            parts.append(data)
            got += len(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def drain(self) -> None:
        while self.read(CHUNK):
            pass

    def close(self) -> str:
        self._worker.close()
        if self._worker.error is not None:
            raise self._worker.error
        return self._hash.hexdigest()
