"""Encode records into a hashing pipeline, and walk them back out of one.

Encoding runs on the caller's thread while `HashingWriter` hashes and writes
(or uploads) the previous chunk; parsing runs while `HashingReader` fetches
and hashes the next.  Neither decides anything about the manifest: the
caller compares digest, size and count once the whole stream has passed.
`FrameIndex` notes where each written frame sits and hashes it on its own
thread, so a later incremental checkpoint can reference it.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable, Container, Iterable, Mapping

import msgspec

from ray_ckpt.errors import CheckpointError, InvalidCheckpointState
from ray_ckpt.identity import check_record_key
from ray_ckpt.storage.durable import WriteStop
from ray_ckpt.storage.pipeline import CHUNK, HashingReader, HashingWriter
from ray_ckpt.storage.record import Record
from ray_ckpt.storage.records_format import FRAME, MAGIC, StateEncoder, decode_state


class FrameIndex:
    """Where each written frame sits in the file, and the sha256 of its bytes.

    The frame digests are computed on a thread of their own, one chunk at a
    time (a frame never spans chunks: a chunk is handed on only between
    frames), so the encoding thread pays only for the bookkeeping."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, int, int, str | None]] = []  # key, offset, length, version
        self.digests: list[str] = []
        self._queue: queue.Queue[tuple[bytes | bytearray, list[tuple[int, int]]] | None] = (
            queue.Queue(maxsize=4)
        )
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ray-ckpt-frames", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self.error is not None:
                continue
            buf, spans = item
            try:
                view = memoryview(buf)
                self.digests.extend(hashlib.sha256(view[a:b]).hexdigest() for a, b in spans)
            except BaseException as exc:
                self.error = exc

    def put(self, buf: bytes | bytearray, spans: list[tuple[int, int]]) -> None:
        if spans:
            self._queue.put((buf, spans))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self.error is not None:
            raise self.error


def encode_records(
    writer: HashingWriter,
    records: Iterable[Record],
    stop: WriteStop,
    *,
    index: FrameIndex | None = None,
    skip: Container[str] = (),
    encoded: Mapping[str, bytes] | None = None,
) -> list[str]:
    """Stream every record into `writer`; every capture key in order.

    Keys in `skip` are checked but not written (an incremental checkpoint
    references them); `encoded` holds frames already encoded for a key (the
    change check made them), written as they are.  `index` learns where each
    written frame sits."""
    encoder = StateEncoder()
    keys: list[str] = []
    buf = bytearray(MAGIC)
    pos = 0  # file offset of buf[0]
    spans: list[tuple[int, int]] = []
    for rec in records:
        stop.check()
        try:
            check_record_key(rec.key)
            keys.append(rec.key)
            if rec.key in skip:
                continue
            start = len(buf)
            frame = encoded.get(rec.key) if encoded is not None else None
            if frame is not None:
                buf += frame
            else:
                encoder.append(buf, rec.key, rec.state)
        except (CheckpointError, TypeError, ValueError, OverflowError) as exc:
            raise InvalidCheckpointState(f"episode {rec.key}: cannot store state: {exc}") from exc
        if index is not None:
            index.spans.append((rec.key, pos + start, len(buf) - start, rec.version))
            spans.append((start, len(buf)))
        if len(buf) >= CHUNK:
            writer.put(buf)
            if index is not None:
                index.put(buf, spans)
                spans = []
            pos += len(buf)
            buf = bytearray()  # a fresh buffer: the threads still hold the last one
    writer.put(buf)
    if index is not None:
        index.put(buf, spans)
    if len(set(keys)) != len(keys):
        raise InvalidCheckpointState("records repeat a capture key")
    return keys


def parse_records(
    reader: HashingReader, select: Callable[[str], bool] | None
) -> tuple[list[str], list[Record], str | None]:
    """Walk the frames; returns (keys, kept records, first problem or None)."""
    keys: list[str] = []
    kept: list[Record] = []
    buf = reader.read(len(MAGIC))
    if buf[: len(MAGIC)] != MAGIC:
        return keys, kept, "bad file header"
    pos = len(MAGIC)
    while True:
        if len(buf) - pos < FRAME.size:
            buf = buf[pos:] + reader.read(FRAME.size)
            pos = 0
            if not buf:
                return keys, kept, None
            if len(buf) < FRAME.size:
                return keys, kept, "truncated frame header"
        key_len, state_len = FRAME.unpack_from(buf, pos)
        need = FRAME.size + key_len + state_len
        if len(buf) - pos < need:
            buf = buf[pos:] + reader.read(need - (len(buf) - pos))
            pos = 0
            if len(buf) < need:
                return keys, kept, f"truncated record after {len(keys)} records"
        view = memoryview(buf)
        start = pos + FRAME.size
        try:
            key = bytes(view[start : start + key_len]).decode("utf-8")
            check_record_key(key)
        except (UnicodeDecodeError, CheckpointError):
            return keys, kept, f"bad capture key in record {len(keys)}"
        keys.append(key)
        if select is None or select(key):
            try:
                state = decode_state(view[start + key_len : pos + need])
            except (msgspec.DecodeError, ValueError) as exc:
                return keys, kept, f"record {key}: {exc}"
            kept.append(Record(key, state))
        pos += need
