"""Restore across files: fetch and verify the frames an incremental manifest references.

What is verified: each referenced file exists with the size recorded; each
frame's bytes, fetched with a ranged read (adjacent frames in one read, up to
`_MAX_READ`), have the sha256 recorded and a header naming the expected key
and lengths.  The whole old file is not re-hashed: its own digest was
verified when it was written and by any restore of its own checkpoint, and
the frame digest covers every byte this restore uses.  A missing file or a
bad frame raises before any record is returned, so a restore fails whole.
See `incremental` for how references are made.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage.blobstore.blobs import BlobMissing, Blobs, blob_name
from ray_ckpt.storage.participant.incremental import root_of
from ray_ckpt.storage.participant.participant_manifest import (
    FrameRef,
    ParticipantManifest,
    participant_key,
)
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.records.records_format import FRAME, decode_state, frame_hash

# Adjacent referenced frames are fetched in one ranged read up to this size,
# and across gaps up to `_GAP` (a few wasted bytes beat one more round trip).
_MAX_READ = 16 << 20
_GAP = 1 << 20
READERS = 2
_AHEAD = 4  # reads in flight: at most _AHEAD * _MAX_READ bytes held


class ReadBuffers:
    """The few buffers a restore's ranged reads go into, reused.

    A fresh 16 MB buffer per read would fault its pages in anew each time
    (on this project's VM the first touch of a page traps to the hypervisor:
    a text-mix chain restore faulted some 130 MB more than a full one and
    took 15-25 % longer).  At most `_AHEAD` + 1 are ever in use: the reads
    in flight and the one being decoded."""

    def __init__(self) -> None:
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= size:
                    return self._free.pop(i)
        return bytearray(max(size, _MAX_READ))

    def give(self, buf: bytearray) -> None:
        with self._lock:
            self._free.append(buf)

    def read(self, root: Blobs, key: str, start: int, length: int) -> tuple[bytearray, memoryview]:
        """One ranged read into a taken buffer: (the buffer, to `give` back
        once nothing refers to it; the view of the bytes read)."""
        buf = self.take(length)
        return buf, root.read_range_into(key, start, memoryview(buf)[:length])


def read_refs(
    here: Blobs, manifest: ParticipantManifest, select: Callable[[str], bool] | None
) -> dict[str, Record]:
    """Fetch and verify every referenced frame; the records `select` keeps."""
    with RefReader(here, manifest) as refs:
        return refs.records(select)


class RefReader:
    """Fetches a manifest's referenced frames on threads, a few reads ahead.

    Made before the own records file is parsed, so the first ranged reads
    overlap that parse; `records` then verifies and decodes them in order.
    Raises `InvalidCheckpointState` naming the file for a missing or resized
    file (at construction), or a frame whose bytes differ from the digest
    recorded.  Memory: at most `_AHEAD` reads of `_MAX_READ` are held."""

    def __init__(self, here: Blobs, manifest: ParticipantManifest) -> None:
        self._root = root_of(here) if manifest.refs else here
        self._pool = ThreadPoolExecutor(READERS, thread_name_prefix="ray-ckpt-refs")
        self._pending: deque[Future[tuple[str, list[FrameRef], bytearray]]] = deque()
        self._buffers = ReadBuffers()
        self._todo = iter(_reads(self._root, manifest))
        # A manifest's references are in its own digest (`incremental.plan`).
        self._digest = frame_hash(manifest.digest_algo)
        self._more(_AHEAD)

    def __enter__(self) -> RefReader:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _more(self, n: int) -> None:
        for key, group in itertools.islice(self._todo, n):
            self._pending.append(
                self._pool.submit(_fetch, self._root, key, group, self._digest, self._buffers)
            )

    def records(self, select: Callable[[str], bool] | None) -> dict[str, Record]:
        kept: dict[str, Record] = {}
        while self._pending:
            key, group, buf = self._pending.popleft().result()
            self._more(1)
            for ref, frame in _frames(self._root, key, group, buf):
                if select is None or select(ref.key):
                    try:
                        kept[ref.key] = Record(ref.key, decode_state(frame))
                    except (msgspec.DecodeError, ValueError) as exc:
                        raise InvalidCheckpointState(
                            f"corrupt record {ref.key} in {blob_name(self._root, key)}: {exc}"
                        ) from exc
            # Every decoded state is a copy: nothing refers to the buffer now.
            self._buffers.give(buf)
        return kept


def ranged_reads(
    here: Blobs, manifest: ParticipantManifest
) -> tuple[Blobs, list[tuple[str, int, int]]]:
    """(root, [(key, start, length)]): the ranged reads a restore of
    `manifest` (at `here`) makes for its references, coalesced as it makes
    them.  For baselines (`benchmarks/storage_incremental.py`)."""
    root = root_of(here) if manifest.refs else here
    out = []
    for key, group in _reads(root, manifest):
        start = group[0].offset
        out.append((key, start, max(r.offset + r.length for r in group) - start))
    return root, out


def _reads(root: Blobs, manifest: ParticipantManifest) -> list[tuple[str, list[FrameRef]]]:
    """The ranged reads to make, once each referenced file is there at its size."""
    pkey = participant_key(manifest.kind, manifest.instance)
    by_file: dict[str, list[FrameRef]] = {}
    for ref in manifest.refs:
        by_file.setdefault(f"{ref.checkpoint}/{pkey}/{ref.records_file}", []).append(ref)
    reads: list[tuple[str, list[FrameRef]]] = []
    for key, refs in by_file.items():
        name = blob_name(root, key)
        try:
            size = root.info(key).size
        except BlobMissing:
            raise InvalidCheckpointState(f"referenced records file {name} is missing") from None
        if size != refs[0].file_bytes:
            raise InvalidCheckpointState(
                f"referenced records file {name} is {size} bytes, manifest says "
                f"{refs[0].file_bytes}"
            )
        reads.extend((key, group) for group in _coalesce(refs))
    return reads


def _coalesce(refs: list[FrameRef]) -> Iterator[list[FrameRef]]:
    group: list[FrameRef] = []
    for ref in sorted(refs, key=lambda r: r.offset):
        if group:
            start, end = group[0].offset, group[-1].offset + group[-1].length
            if ref.offset - end > _GAP or ref.offset + ref.length - start > _MAX_READ:
                yield group
                group = []
        group.append(ref)
    if group:
        yield group


def _fetch(
    root: Blobs,
    key: str,
    group: list[FrameRef],
    digest: Callable[[bytes | bytearray | memoryview], bytes],
    buffers: ReadBuffers,
) -> tuple[str, list[FrameRef], bytearray]:
    start = group[0].offset
    end = max(r.offset + r.length for r in group)
    try:
        buf, data = buffers.read(root, key, start, end - start)
    except BlobMissing:
        raise InvalidCheckpointState(
            f"referenced records file {blob_name(root, key)} is missing"
        ) from None
    # Hashed here, on the reader threads (hashlib and blake3 release the GIL).
    for ref in group:
        view = data[ref.offset - start : ref.offset - start + ref.length]
        if len(view) != ref.length or digest(view).hex() != ref.digest:
            raise InvalidCheckpointState(
                f"digest mismatch in {blob_name(root, key)} at offset {ref.offset} "
                f"(record {ref.key}): referenced records are corrupt"
            )
    return key, group, buf


def _frames(
    root: Blobs, key: str, group: list[FrameRef], data: bytearray
) -> Iterator[tuple[FrameRef, memoryview]]:
    """Each verified frame's state bytes, after checking its header names it."""
    start = group[0].offset
    view = memoryview(data)
    for ref in group:
        at = ref.offset - start
        key_len, state_len = FRAME.unpack_from(view, at) if ref.length >= FRAME.size else (0, -1)
        head = at + FRAME.size
        if FRAME.size + key_len + state_len != ref.length or bytes(
            view[head : head + key_len]
        ) != ref.key.encode("utf-8"):
            raise InvalidCheckpointState(
                f"frame at offset {ref.offset} of {blob_name(root, key)} is not record {ref.key}"
            )
        yield ref, view[head + key_len : at + ref.length]
