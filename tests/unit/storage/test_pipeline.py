"""ChunkWriter: every chunk reaches the sink in order; a one-chunk stream
starts no thread."""

from __future__ import annotations

import threading

import pytest

from ray_ckpt.storage.records.pipeline import ChunkWriter


def _recording() -> tuple[list[tuple[bytes, str]], ChunkWriter]:
    seen: list[tuple[bytes, str]] = []
    writer = ChunkWriter(lambda c: seen.append((bytes(c), threading.current_thread().name)))
    return seen, writer


def test_one_chunk_is_written_at_close_on_the_callers_thread() -> None:
    seen, writer = _recording()
    before = threading.active_count()
    writer.put(b"only")
    assert seen == []
    assert threading.active_count() == before
    writer.close()
    assert seen == [(b"only", threading.current_thread().name)]
    assert writer.size == 4


def test_many_chunks_go_in_order_on_a_writer_thread() -> None:
    seen, writer = _recording()
    chunks = [bytes([i]) * (i + 1) for i in range(10)]
    for c in chunks:
        writer.put(c)
    writer.close()
    assert [c for c, _ in seen] == chunks
    assert {name for _, name in seen} == {"ray-ckpt-write"}
    assert writer.size == sum(map(len, chunks))


def test_an_empty_stream_writes_nothing() -> None:
    seen, writer = _recording()
    writer.close()
    assert seen == []


@pytest.mark.parametrize("count", [1, 3])
def test_the_sinks_error_is_raised(count: int) -> None:
    def sink(_chunk: bytes | bytearray) -> None:
        raise OSError(28, "No space left on device")

    writer = ChunkWriter(sink)
    with pytest.raises(OSError, match="No space"):
        for _ in range(count):
            writer.put(b"x")
        writer.close()
