"""The records file format: length-framed MessagePack, one frame per record.

Choice, by measurement (this machine, CPython 3.11, msgspec 0.23, orjson
3.13; 20 states of 350 KB each; MB/s of the state's stdlib-JSON size):

    mix      stdlib json enc/dec   msgspec msgpack enc/dec   orjson dumps
    text          298 / 294              2889 / 859               1791
    numbers        45 /  64              1753 / 457                245

MessagePack through msgspec is 6-40x faster than stdlib JSON to encode and
3-7x faster to decode, and it is bit-exact: floats are stored as IEEE-754
doubles, so NaN, +inf, -inf and -0.0 survive, maps keep their key order, and
`bytes` stay `bytes` (stdlib JSON cannot hold bytes at all; orjson and
msgspec JSON write NaN as null).  The files are also smaller (6.2 MB vs
7.2 MB text, 3.4 MB vs 7.2 MB numbers).

Digest, by measurement (64 MiB in one update): sha256 1623 MB/s (SHA-NI),
sha1 1711, blake2b 800, md5 669, sha512 727, blake2s 434, sha3_256 309 MB/s;
later, 360 MB of the text mix in 360 KB frames: sha256 0.32 s, BLAKE3 (the
`blake3` package, one thread) 0.07 s.  BLAKE3 is a cryptographic hash like
sha256, so a digest still names a frame's bytes for incremental references;
it is the digest written since ("blake3-frames").

The records file's digest (`digest_algo` "blake3-frames", `frames_digest`)
is the hash of the magic followed by each frame's own 32-byte hash, in file
order: a hash list.  "sha256-frames" is the same with sha256 (written before
BLAKE3; still read).  Each frame's digest is needed anyway (incremental
checkpoints reference frames by it), so the file is hashed once, not twice;
before, "sha256" hashed the whole file as well (0.21 s of CPU more per
360 MB here).  Frames delimit themselves and the magic is compared as it is,
so an equal digest and size still mean an equal file: a reader hashes every
frame it parses and compares the digest made of them.  Files written with
"sha256" are still read, and verified with a whole-file hash.

End to end, in an early run (`python benchmarks/storage.py --sessions 1000
--kb 350 --json`, whole-file sha256, medians of 3 interleaved runs on a
shared 2-core VM whose disk timings vary 2-3x between runs; seconds; the
benchmarks/README.md has the current figures):

    mix      commit  peer  raw write | restore  peer  raw read+decode
    text      1.27   3.82    1.43    |  1.44    1.50       1.79
    numbers   0.53  16.41    0.74    |  3.97    9.51       2.50

(peer: one stdlib-json line per record through sha256, fsync, rename, read
back with json.loads; the records file is 360 MB text / 181 MB numbers, the
peer's 365 / 383 MB.)  Commit's extra peak RSS is a few chunks (< 50 MB);
restore's is the restored objects themselves, as for the peer.

What msgspec's MessagePack cannot hold natively, and what this format does:

* integers beyond the 64-bit range (msgpack has int64 and uint64 only) are
  written as extension type 1 holding the decimal digits, and decode back to
  the same `int`;
* strings with lone surrogates (legal Python `str`, not encodable as UTF-8)
  are written as extension type 2 holding UTF-8 with ``surrogatepass``, for
  values and dict keys alike, and decode back to the same `str`.

Both go through a fallback that rebuilds the value only when the fast encode
refuses it, so ordinary states pay nothing.  Tuples are written as arrays and
come back as lists (JSON has one array type).

Layout: an 8-byte magic, then per record a frame header (key length u16,
state length u64, little-endian), the capture key in UTF-8, and the state's
MessagePack.  Keys sit outside the state so restore can skip decoding the
states it does not keep while still hashing every byte.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable
from typing import Any

import blake3
import msgspec

FORMAT = "msgpack-frames/1"
FRAMES_DIGEST = "blake3-frames"  # written
SHA256_FRAMES_DIGEST = "sha256-frames"  # written before BLAKE3; read
WHOLE_FILE_DIGEST = "sha256"  # the whole file's, before the frames digest; read


def _blake3(data: bytes | bytearray | memoryview) -> bytes:
    return blake3.blake3(data).digest()


def _sha256(data: bytes | bytearray | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


_FRAME_HASHES: dict[str, Callable[[bytes | bytearray | memoryview], bytes]] = {
    FRAMES_DIGEST: _blake3,
    SHA256_FRAMES_DIGEST: _sha256,
    WHOLE_FILE_DIGEST: _sha256,  # such manifests hold no frames and no refs
}


def frame_hash(algo: str) -> Callable[[bytes | bytearray | memoryview], bytes]:
    """The 32-byte digest of one frame under a manifest's `digest_algo`."""
    try:
        return _FRAME_HASHES[algo]
    except KeyError:
        raise ValueError(f"unknown digest {algo!r}") from None


MAGIC = b"RCKREC1\n"
FRAME = struct.Struct("<HQ")
MAX_KEY_BYTES = 0xFFFF

_EXT_BIGINT = 1
_EXT_SURROGATE_STR = 2


class _SurrogateKey:
    """A dict key carrying lone surrogates; hashable so it can stay a key."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __hash__(self) -> int:
        return hash(self.text)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SurrogateKey) and other.text == self.text


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, _SurrogateKey):
        return msgspec.msgpack.Ext(_EXT_SURROGATE_STR, obj.text.encode("utf-8", "surrogatepass"))
    raise TypeError(f"records cannot hold a {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _EXT_BIGINT:
        return int(bytes(data).decode("ascii"))
    if code == _EXT_SURROGATE_STR:
        return bytes(data).decode("utf-8", "surrogatepass")
    raise ValueError(f"unknown extension type {code}")


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _lower(value: Any) -> Any:
    """A copy of `value` with big ints and surrogate strings as extensions."""
    t = type(value)
    if t is int:
        if -(1 << 63) <= value < (1 << 64):
            return value
        return msgspec.msgpack.Ext(_EXT_BIGINT, str(value).encode("ascii"))
    if t is str:
        if _has_surrogate(value):
            return msgspec.msgpack.Ext(_EXT_SURROGATE_STR, value.encode("utf-8", "surrogatepass"))
        return value
    if t is list or t is tuple:
        return [_lower(v) for v in value]
    if t is dict:
        return {
            (_SurrogateKey(k) if type(k) is str and _has_surrogate(k) else k): _lower(v)
            for k, v in value.items()
        }
    return value


class StateEncoder:
    """Encodes framed records; one per write (not thread-safe)."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder(enc_hook=_enc_hook)

    def frame(self, key: str, state: Any) -> tuple[bytes, bytes]:
        """One frame for (key, state) as two pieces: its header with the key,
        and the state's MessagePack (joined, the frame's bytes)."""
        key_bytes = key.encode("utf-8")
        if len(key_bytes) > MAX_KEY_BYTES:
            raise ValueError(f"capture key of {len(key_bytes)} bytes is too long")
        try:
            body = self._enc.encode(state)
        except (OverflowError, UnicodeEncodeError):
            body = self._enc.encode(_lower(state))
        return FRAME.pack(len(key_bytes), len(body)) + key_bytes, body

    def encode_state(self, state: Any) -> bytes:
        """The MessagePack of one state alone (tests and tools)."""
        buf = bytearray()
        try:
            self._enc.encode_into(state, buf)
        except (OverflowError, UnicodeEncodeError):
            buf.clear()
            self._enc.encode_into(_lower(state), buf)
        return bytes(buf)


_DECODER = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def decode_state(data: bytes | memoryview) -> Any:
    """Decode one state's MessagePack (raises msgspec.DecodeError / ValueError)."""
    return _DECODER.decode(data)


def frames_digest(frame_digests: Iterable[bytes], algo: str = FRAMES_DIGEST) -> str:
    """The records file's digest from its frames' digests, in file order."""
    if algo == FRAMES_DIGEST:
        h3 = blake3.blake3(MAGIC)
        for d in frame_digests:
            h3.update(d)
        return h3.hexdigest()
    h = hashlib.sha256(MAGIC)
    for d in frame_digests:
        h.update(d)
    return h.hexdigest()
