"""Length-prefixed msgpack frames on a stream (the host <-> worker wire).

A frame is a 4-byte big-endian length and that many bytes of msgpack.
msgpack, not JSON: exported states may hold `bytes`, which it keeps.
Frames are bounded both ways: a length over `max_bytes` is refused before a
byte of its body is read (`FrameError`), so a confused or hostile peer cannot
make the other side allocate without bound.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgspec

# Exports travel in one frame per worker; a records file is bounded far
# below this in practice, and NeMo Gym bounds its frames at 1 GiB.
DEFAULT_MAX_FRAME_BYTES = 1024 * 1024 * 1024
_HEADER = struct.Struct(">I")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class FrameError(Exception):
    """A malformed or oversized frame: the connection cannot be trusted further."""


def encode(message: Any, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    payload = _encoder.encode(message)
    if len(payload) > max_bytes:
        raise FrameError(f"frame of {len(payload)} bytes exceeds the {max_bytes}-byte bound")
    return _HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Any:
    """The next message; `asyncio.IncompleteReadError` at a clean or torn end."""
    header = await reader.readexactly(_HEADER.size)
    (length,) = _HEADER.unpack(header)
    if length > max_bytes:
        raise FrameError(f"peer announced a {length}-byte frame (bound {max_bytes})")
    payload = await reader.readexactly(length)
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise FrameError(f"undecodable frame: {exc}") from None
