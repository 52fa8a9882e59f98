"""Encode records into a hashing pipeline, and walk them back out of one.

Encoding runs on the caller's thread while `HashingWriter` hashes and writes
(or uploads) the previous chunk; parsing runs while `HashingReader` fetches
and hashes the next.  Neither decides anything about the manifest: the
caller compares digest, size and count once the whole stream has passed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from ray_ckpt.errors import CheckpointError, InvalidCheckpointState
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.durable import WriteStop
from ray_ckpt.storage.pipeline import CHUNK, HashingReader, HashingWriter
from ray_ckpt.storage.record import Record
from ray_ckpt.storage.records_format import FRAME, MAGIC, StateEncoder, decode_state


def encode_records(writer: HashingWriter, records: Iterable[Record], stop: WriteStop) -> list[str]:
    """Stream every record into `writer`; the capture keys in order."""
    encoder = StateEncoder()
    keys: list[str] = []
    buf = bytearray(MAGIC)
    for rec in records:
        stop.check()
        try:
            EpisodeId.from_capture_key(rec.key)
            encoder.append(buf, rec.key, rec.state)
        except (CheckpointError, TypeError, ValueError, OverflowError) as exc:
            raise InvalidCheckpointState(f"episode {rec.key}: cannot store state: {exc}") from exc
        keys.append(rec.key)
        if len(buf) >= CHUNK:
            writer.put(buf)
            buf = bytearray()  # a fresh buffer: the threads still hold the last one
    writer.put(buf)
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
            EpisodeId.from_capture_key(key)
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
