"""Chunk pipelines: hash and write (or read and hash) on threads while the caller works.

hashlib, os.write/os.read and the object-store client release the GIL for
large buffers, so a chunk can be hashed on one thread and written (uploaded)
on another while the caller encodes the next; on the way back one thread
fetches chunks ahead (a disk read or a download) while the caller parses.
Bounded queues keep memory to a few chunks.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable, Iterator

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


class HashingWriter:
    """Hand chunks to `sink` (a file or an upload) and sha256 them, on two threads."""

    def __init__(self, sink: Callable[[Chunk], None]) -> None:
        self._hash = hashlib.sha256()
        self.size = 0
        self._workers = [
            _Worker(self._hash.update, "ray-ckpt-hash"),
            _Worker(sink, "ray-ckpt-write"),
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


class ChunkWriter:
    """Hand chunks to `sink` (a file or an upload) on a thread; no file-wide
    hash (the records file's digest is made of its frames' digests).

    The thread starts with the second chunk: a stream of one chunk (a small
    participant's whole state) is written on the caller's thread at `close`,
    as a thread would only add its start (about a millisecond on a loaded
    machine, once per participant in every checkpoint) to the pause."""

    def __init__(self, sink: Callable[[Chunk], None]) -> None:
        self.size = 0
        self._sink = sink
        self._held: Chunk | None = None
        self._worker: _Worker | None = None

    def put(self, chunk: Chunk) -> None:
        self.size += len(chunk)
        if self._worker is None:
            if self._held is None:
                self._held = chunk
                return
            self._worker = _Worker(self._sink, "ray-ckpt-write")
            self._worker.put(self._held)
            self._held = None
        if self._worker.error is not None:
            raise self._worker.error
        self._worker.put(chunk)

    def close(self) -> None:
        """Wait for every chunk (raises the sink's error)."""
        if self._worker is None:
            held, self._held = self._held, None
            if held is not None:
                self._sink(held)
            return
        self._worker.close()
        if self._worker.error is not None:
            raise self._worker.error


class _Prefetch:
    """Pulls chunks from an iterator on its own thread, a few ahead of the reader."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._queue: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=_DEPTH)
        self._quit = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(chunks,), name="ray-ckpt-read", daemon=True
        )
        self._thread.start()

    def _run(self, chunks: Iterator[bytes]) -> None:
        try:
            for data in chunks:
                if self._quit.is_set():
                    break
                if data:
                    self._queue.put(data)
            self._queue.put(None)
        except BaseException as exc:
            self._queue.put(exc)
        finally:
            # Closed on the thread that ran it: a generator cannot be closed
            # from another thread while it runs.
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    def get(self) -> bytes | None:
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._queue.put(None)  # later gets see the end, not a hang
            raise item
        if item is None:
            self._queue.put(None)
        return item

    def close(self) -> None:
        self._quit.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
        self._thread.join()


class HashingReader:
    """Read a stream of chunks, hashing each on a thread as it is handed out
    (with `hash=False` not: the caller hashes the frames it parses)."""

    def __init__(self, chunks: Iterator[bytes], *, hash: bool = True) -> None:
        self._source = _Prefetch(chunks)
        self._hash = hashlib.sha256()
        self._worker = _Worker(self._hash.update, "ray-ckpt-hash") if hash else None
        self._ended = False
        self.size = 0

    def read(self, want: int) -> bytes:
        """At least `want` bytes unless the stream ends first (b"" at the end)."""
        parts: list[bytes] = []
        got = 0
        while got < want and not self._ended:
            data = self._source.get()
            if data is None:
                self._ended = True
                break
            if self._worker is not None:
                self._worker.put(data)
            self.size += len(data)
            parts.append(data)
            got += len(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def drain(self) -> None:
        while self.read(CHUNK):
            pass

    def close(self) -> str:
        """The stream's sha256 ("" with `hash=False`)."""
        self._source.close()
        if self._worker is None:
            return ""
        self._worker.close()
        if self._worker.error is not None:
            raise self._worker.error
        return self._hash.hexdigest()
