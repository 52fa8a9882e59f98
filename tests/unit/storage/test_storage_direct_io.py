"""Uploads on disk: whole blocks around the page cache, the tail through it,
a buffered fallback (with the writeback hint) where O_DIRECT is refused;
every way, the file holds exactly the bytes written."""

from __future__ import annotations

import errno
import itertools
import os
import threading
from pathlib import Path

import pytest

from ray_ckpt.storage.blobstore import direct_io, writeback
from ray_ckpt.storage.blobstore.direct_io import BLOCK, StreamWriter
from ray_ckpt.storage.blobstore.local_blobs import LocalBlobs

# Odd sizes, so blocks are cut inside chunks: 2 whole blocks and a tail.
CHUNKS = [
    os.urandom(BLOCK - 3),
    bytearray(os.urandom(5)),
    memoryview(os.urandom(BLOCK + 1000)),
    b"tail" * 7,
]
EXPECTED = b"".join(bytes(c) for c in CHUNKS)


def _supports_direct(where: Path) -> bool:
    try:
        fd = os.open(where / ".probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    os.unlink(where / ".probe")
    return True


def _write(path: Path, chunks: list[bytes | bytearray | memoryview], **kw: bool) -> StreamWriter:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        out = StreamWriter(fd, **kw)
        for c in chunks:
            out.write(c)
        out.finish()
        os.fsync(fd)
    finally:
        os.close(fd)
    return out


def test_an_upload_writes_whole_blocks_direct_and_the_tail_buffered(tmp_path: Path) -> None:
    if not _supports_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    out = _write(tmp_path / "f", CHUNKS, direct=True)
    assert (tmp_path / "f").read_bytes() == EXPECTED
    assert out.size == len(EXPECTED)
    assert out.direct_bytes == 2 * BLOCK  # the rest (1,026 bytes) went through the cache
    # Through the store's upload, with the default (on): the same bytes.
    blobs = LocalBlobs(tmp_path / "store")
    with blobs.upload("p/records") as up:
        for c in CHUNKS:
            up.write(c)
    assert (tmp_path / "store" / "p" / "records").read_bytes() == EXPECTED


def test_a_file_smaller_than_a_block_never_goes_direct(tmp_path: Path) -> None:
    out = _write(tmp_path / "f", [b"x" * 1000, b"y" * (BLOCK - 1001)], direct=True)
    assert out.direct_bytes == 0
    assert (tmp_path / "f").read_bytes() == b"x" * 1000 + b"y" * (BLOCK - 1001)


@pytest.mark.parametrize("refused", ["fcntl", "write"])
def test_where_o_direct_is_refused_the_rest_goes_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: str
) -> None:
    """A file system may refuse the flag, or accept it and refuse the write
    (EINVAL either way): the block in hand and everything after are written
    buffered, and nothing is lost or doubled."""
    real_set, real_pwrite = direct_io._set_direct, os.pwrite

    def set_direct(fd: int, on: bool) -> bool:
        return False if (on and refused == "fcntl") else real_set(fd, on)

    def pwrite(fd: int, data: bytes | memoryview, offset: int) -> int:
        if refused == "write" and len(data) == BLOCK:
            flags = direct_io.fcntl.fcntl(fd, direct_io.fcntl.F_GETFL)
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(direct_io, "_set_direct", set_direct)
    monkeypatch.setattr(direct_io.os, "pwrite", pwrite)
    out = _write(tmp_path / "f", CHUNKS, direct=True)
    assert out.direct_bytes == 0
    assert (tmp_path / "f").read_bytes() == EXPECTED


def test_turned_off_each_chunk_is_written_buffered_with_its_writeback_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int]] = []
    real = writeback.start_writeback

    def record(fd: int, offset: int, length: int) -> None:
        calls.append((offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(direct_io, "start_writeback", record)
    monkeypatch.setenv("RAY_CKPT_DIRECT_IO", "0")
    blobs = LocalBlobs(tmp_path)
    with blobs.upload("p/records") as up:
        for chunk in CHUNKS:
            up.write(chunk)
    assert (tmp_path / "p" / "records").read_bytes() == EXPECTED
    # Contiguous ranges covering the file, one per chunk.
    offsets = [0]
    for c in CHUNKS[:-1]:
        offsets.append(offsets[-1] + len(c))
    assert calls == [(o, len(c)) for o, c in zip(offsets, CHUNKS, strict=True)]


def test_the_hint_never_raises(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"x" * 100)
    writeback.start_writeback(fd, 0, 100)
    writeback.start_writeback(fd, 0, 0)
    os.close(fd)
    writeback.start_writeback(fd, 0, 100)  # a closed descriptor: EBADF, ignored
    writeback.start_writeback(-1, 0, 100)


def test_a_failed_upload_leaves_nothing(tmp_path: Path) -> None:
    blobs = LocalBlobs(tmp_path)

    def fail() -> None:
        with blobs.upload("p/records") as up:
            up.write(os.urandom(BLOCK + 10))
            raise RuntimeError("the encoder failed")

    with pytest.raises(RuntimeError):
        fail()
    assert list((tmp_path / "p").iterdir()) == []


def test_many_blocks_reuse_two_buffers_and_land_in_order(tmp_path: Path) -> None:
    """A block is written on a thread while the next fills; five blocks and
    a tail in uneven chunks come out byte for byte, and no thread is left."""
    if not _supports_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    data = os.urandom(5 * BLOCK + 4321)
    cuts = [0, 1, 3 * 1024 * 1024, BLOCK + 7, 3 * BLOCK, 3 * BLOCK + 1, len(data)]
    chunks: list[bytes | bytearray | memoryview] = [data[a:b] for a, b in itertools.pairwise(cuts)]
    before = {t.name for t in threading.enumerate()}
    out = _write(tmp_path / "f", chunks, direct=True)
    assert (tmp_path / "f").read_bytes() == data
    assert out.direct_bytes == 5 * BLOCK
    assert {t.name for t in threading.enumerate()} - before == set()
