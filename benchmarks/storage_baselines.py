"""The storage benchmark's baselines, measured in the benchmark's own location.

* raw (the physical floor): the encoded records themselves, pre-encoded
  into the same chunks our writer produces, so the bytes are exactly our
  records file's.  On disk: written and fsynced into a file in the
  location the way our upload writes (whole 4 MB blocks with O_DIRECT from
  one aligned buffer, the tail buffered: `ray_ckpt.storage.blobstore.direct_io`, the
  same kernel work minus encoding and hashing), read back with `os.read`.
  For comparison, two buffered `os.write` loops of the same chunks:
  `raw_write_buffered_s` starting each chunk's writeback as it is written,
  `raw_write_plain_s` without (on this machine both are fast or 3-4x slower
  by whether the page cache gets recently freed pages).  On an object store: one obstore put
  of those chunks (multipart, as obstore does a large body best) and a get.
* raw read + decode (the format's floor for restore): the raw read on one
  thread while this thread walks the frames and decodes each state, with no
  digest, key check or count.  Overlapped like our restore, or it would not
  bound it: a sequential read-then-decode is beaten by any pipelined reader.
* peer: one stdlib-json line per record through sha256 into the location
  (`Blobs.upload`: temp file, fsync, link on disk; multipart on a store), read
  back line by line with `json.loads`.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import queue
import threading
from collections.abc import Iterator
from typing import Any, Protocol

from ray_ckpt.storage import Blobs, WriteStop
from ray_ckpt.storage.blobstore.direct_io import StreamWriter
from ray_ckpt.storage.blobstore.writeback import start_writeback
from ray_ckpt.storage.records.pipeline import CHUNK
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.records.records_format import FRAME, MAGIC, decode_state
from ray_ckpt.storage.records.records_io import encode_records, records_digest


def encode_chunks(records: list[Record]) -> list[bytes]:
    """Our records file's bytes, cut where our writer cuts them."""
    chunks: list[bytes] = []

    class Collect:
        def put(self, chunk: bytes | bytearray) -> None:
            chunks.append(bytes(chunk))

    encode_records(Collect(), records, WriteStop())
    return chunks


def digest_of(chunks: list[bytes]) -> str:
    """The digest our manifest gives these bytes (made of their frames' digests)."""
    return records_digest(chunks)


class RawStore(Protocol):
    def write(self, key: str, chunks: list[bytes]) -> None: ...

    def read(self, key: str) -> Iterator[bytes]: ...


class DiskRaw:
    """Plain files under the location's directory."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root

    def write(self, key: str, chunks: list[bytes], *, mode: str = "direct") -> None:
        """`direct`: whole blocks around the page cache, as our upload writes
        (`ray_ckpt.storage.blobstore.direct_io`); `hint`: buffered, each chunk's
        writeback started; `plain`: buffered, nothing more."""
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if mode == "direct":
                out = StreamWriter(fd)
                for c in chunks:
                    out.write(c)
                out.finish()
            else:
                offset = 0
                for c in chunks:
                    view = memoryview(c)
                    while view:
                        view = view[os.write(fd, view) :]
                    if mode == "hint":
                        start_writeback(fd, offset, len(c))
                    offset += len(c)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, key: str) -> Iterator[bytes]:
        fd = os.open(self.root / key, os.O_RDONLY)
        try:
            while data := os.read(fd, CHUNK):
                yield data
        finally:
            os.close(fd)


class StoreRaw:
    """Objects under the location's prefix, through obstore with its defaults."""

    def __init__(self, url: str) -> None:
        from obstore.store import from_url

        self._store = from_url(url)

    def write(self, key: str, chunks: list[bytes]) -> None:
        import obstore

        obstore.put(self._store, key, iter(chunks))

    def read(self, key: str) -> Iterator[bytes]:
        import obstore

        for chunk in obstore.get(self._store, key).stream(min_chunk_size=CHUNK):
            yield bytes(chunk)


def raw_read(raw: RawStore, key: str) -> int:
    return sum(len(c) for c in raw.read(key))


def _prefetched(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """`chunks`, pulled a few ahead on a thread (the read overlaps the decode)."""
    q: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=4)

    def pull() -> None:
        try:
            for c in chunks:
                q.put(c)
            q.put(None)
        except BaseException as exc:
            q.put(exc)

    t = threading.Thread(target=pull, daemon=True)
    t.start()
    while (item := q.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        yield item
    t.join()


def raw_read_decode(raw: RawStore, key: str) -> list[Any]:
    """The format's floor: the bytes read ahead, each state decoded bare."""
    out: list[Any] = []
    buf = b""
    pos = 0
    for n, data in enumerate(_prefetched(raw.read(key))):
        buf = buf[pos:] + data if pos < len(buf) else data
        pos = len(MAGIC) if n == 0 else 0
        view = memoryview(buf)
        while len(buf) - pos >= FRAME.size:
            key_len, state_len = FRAME.unpack_from(buf, pos)
            start = pos + FRAME.size + key_len
            if start + state_len > len(buf):
                break
            out.append(decode_state(view[start : start + state_len]))
            pos = start + state_len
        del view
    return out


def peer_commit(blobs: Blobs, key: str, records: list[Record]) -> str:
    h = hashlib.sha256()
    with blobs.upload(key) as up:
        buf = bytearray()
        for rec in records:
            line = (json.dumps({"key": rec.key, "state": rec.state}) + "\n").encode()
            h.update(line)
            buf += line
            if len(buf) >= CHUNK:
                up.write(buf)
                buf = bytearray()
        up.write(buf)
    return h.hexdigest()


def peer_restore(blobs: Blobs, key: str) -> list[Any]:
    out: list[Any] = []
    tail = b""
    for data in blobs.stream(key):
        lines = (tail + data).split(b"\n")
        tail = lines.pop()
        out.extend(json.loads(line) for line in lines)
    if tail:
        out.append(json.loads(tail))
    return out
