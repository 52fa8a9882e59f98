"""The writeback hint: each chunk of an upload is handed to the disk as it is
written, and the hint never fails a write."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ray_ckpt.storage import local_blobs, writeback
from ray_ckpt.storage.local_blobs import LocalBlobs


def test_an_upload_starts_the_writeback_of_every_chunk_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int]] = []
    real = writeback.start_writeback

    def record(fd: int, offset: int, length: int) -> None:
        calls.append((offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(local_blobs, "start_writeback", record)
    blobs = LocalBlobs(tmp_path)
    chunks = [b"a" * 1000, b"b" * 4096, bytearray(b"c" * 7), memoryview(b"d" * 300)]
    with blobs.upload("p/records") as up:
        for chunk in chunks:
            up.write(chunk)
    assert (tmp_path / "p" / "records").read_bytes() == b"".join(bytes(c) for c in chunks)
    # Contiguous ranges covering the file, one per chunk.
    offsets = [0, 1000, 5096, 5103]
    assert calls == [(o, len(c)) for o, c in zip(offsets, chunks, strict=True)]


def test_the_hint_never_raises(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"x" * 100)
    writeback.start_writeback(fd, 0, 100)
    writeback.start_writeback(fd, 0, 0)
    os.close(fd)
    writeback.start_writeback(fd, 0, 100)  # a closed descriptor: EBADF, ignored
    writeback.start_writeback(-1, 0, 100)
