"""The records file's digest made of its frames' digests ("sha256-frames"):
every byte still verified on restore, a corrupt or torn file refused whole,
checkpoints written with the whole-file digest ("sha256") still read."""

from __future__ import annotations

import hashlib
import pathlib
from typing import Any

import msgspec
import pytest

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage import (
    ParticipantManifest,
    participant_dir,
    read_participant,
    write_participant,
)
from ray_ckpt.storage.manifest_shapes import verify_participant
from ray_ckpt.storage.participant_manifest import MANIFEST_NAME, decode_manifest
from ray_ckpt.storage.participant_store import encode_manifest
from ray_ckpt.storage.record import Record
from ray_ckpt.storage.records_format import FRAME, MAGIC
from ray_ckpt.storage.records_io import records_digest

KIND, INST = "environment", "env-0"


def records(n: int = 4, tag: str = "") -> list[Record]:
    return [Record(f"r{i}", {"i": i, "text": f"{tag}é" * 300, "b": b"\x01" * 50}) for i in range(n)]


def write(d: pathlib.Path, recs: list[Record] | None = None, **kw: Any) -> ParticipantManifest:
    return write_participant(
        d, kind=KIND, instance=INST, checkpoint_id="c1", records=recs or records(), **kw
    )


def files(d: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    pd = participant_dir(d, KIND, INST)
    return pd / MANIFEST_NAME, next(pd.glob("records-*.msgpack"))


def read(d: pathlib.Path, only: str | None = None) -> list[Record]:
    select = None if only is None else (lambda k: k == only)
    return read_participant(d, kind=KIND, instance=INST, checkpoint_id="c1", select=select)[1]


def test_the_digest_is_the_frames_and_a_tool_computes_it_from_the_bytes(
    tmp_path: pathlib.Path,
) -> None:
    write(tmp_path)
    mpath, rpath = files(tmp_path)
    m = decode_manifest(mpath.read_bytes(), "m")
    data = rpath.read_bytes()
    assert m.digest_algo == "sha256-frames"
    assert records_digest([data]) == m.digest
    # Cut anywhere between chunks: the same digest.
    assert records_digest([data[:5], data[5:1000], data[1000:]]) == m.digest
    assert m.digest != hashlib.sha256(data).hexdigest()


def regions(data: bytes) -> dict[str, int]:
    """A byte offset in each part of the file: magic, a frame header, a key, a state."""
    first = len(MAGIC)
    key_len, state_len = FRAME.unpack_from(data, first)
    last_state = len(data) - 2
    return {
        "magic": 3,
        "frame header": first + 1,
        "key": first + FRAME.size,
        "first state": first + FRAME.size + key_len + state_len // 2,
        "last state": last_state,
    }


@pytest.mark.parametrize("region", ["magic", "frame header", "key", "first state", "last state"])
def test_a_flipped_byte_anywhere_is_refused_whole_even_out_of_scope(
    tmp_path: pathlib.Path, region: str
) -> None:
    write(tmp_path)
    _, rpath = files(tmp_path)
    data = bytearray(rpath.read_bytes())
    data[regions(bytes(data))[region]] ^= 0x40
    rpath.write_bytes(bytes(data))
    with pytest.raises(InvalidCheckpointState):
        read(tmp_path, only="r2")  # a record whose own bytes are intact
    with pytest.raises(InvalidCheckpointState):
        verify_participant(tmp_path, KIND, INST, checkpoint_id="c1")


@pytest.mark.parametrize("cut", [1, 9, 200])
def test_a_torn_file_is_refused(tmp_path: pathlib.Path, cut: int) -> None:
    write(tmp_path)
    mpath, rpath = files(tmp_path)
    rpath.write_bytes(rpath.read_bytes()[:-cut])
    with pytest.raises(InvalidCheckpointState, match="truncated"):
        read(tmp_path)
    # Even with the manifest's size made to agree, the digest does not.
    m = decode_manifest(mpath.read_bytes(), "m")
    mpath.write_bytes(encode_manifest(msgspec.structs.replace(m, bytes=m.bytes - cut)))
    with pytest.raises(InvalidCheckpointState, match=r"digest mismatch|truncated"):
        read(tmp_path)


def test_a_matching_digest_over_an_undecodable_state_is_still_refused(
    tmp_path: pathlib.Path,
) -> None:
    write(tmp_path)
    mpath, rpath = files(tmp_path)
    body = MAGIC + FRAME.pack(2, 3) + b"r0" + b"\xc1\xc1\xc1"
    rpath.write_bytes(body)
    m = decode_manifest(mpath.read_bytes(), "m")
    forged = msgspec.structs.replace(
        m, digest=records_digest([body]), bytes=len(body), record_count=1, episodes=["r0"]
    )
    mpath.write_bytes(encode_manifest(forged))
    with pytest.raises(InvalidCheckpointState, match=r"corrupt records .*record r0"):
        read(tmp_path)


def as_whole_file_digest(d: pathlib.Path) -> None:
    """Rewrite the manifest as the code before the frames digest wrote it."""
    mpath, rpath = files(d)
    m = decode_manifest(mpath.read_bytes(), "m")
    old = msgspec.structs.replace(
        m, digest_algo="sha256", digest=hashlib.sha256(rpath.read_bytes()).hexdigest()
    )
    mpath.write_bytes(encode_manifest(old))


def test_a_checkpoint_with_the_whole_file_digest_still_restores_and_is_verified(
    tmp_path: pathlib.Path,
) -> None:
    recs = records()
    write(tmp_path, recs)
    as_whole_file_digest(tmp_path)
    assert [r.state for r in read(tmp_path)] == [r.state for r in recs]
    verify_participant(tmp_path, KIND, INST, checkpoint_id="c1")
    # Its recommit compares the whole-file digest: the same records pass ...
    again = write(tmp_path, recs, frame_index=False)
    assert again.digest_algo == "sha256"
    # ... and a flipped byte is refused as before.
    _, rpath = files(tmp_path)
    data = bytearray(rpath.read_bytes())
    data[-2] ^= 0x40
    rpath.write_bytes(bytes(data))
    with pytest.raises(InvalidCheckpointState, match="digest mismatch"):
        read(tmp_path, only="r0")


def test_a_manifest_naming_the_wrong_kind_of_digest_is_refused(tmp_path: pathlib.Path) -> None:
    write(tmp_path)
    mpath, rpath = files(tmp_path)
    m = decode_manifest(mpath.read_bytes(), "m")
    # The frames digest labelled as a whole-file one (or the reverse) fails.
    mpath.write_bytes(encode_manifest(msgspec.structs.replace(m, digest_algo="sha256")))
    with pytest.raises(InvalidCheckpointState, match="digest mismatch"):
        read(tmp_path)
    whole = hashlib.sha256(rpath.read_bytes()).hexdigest()
    mpath.write_bytes(encode_manifest(msgspec.structs.replace(m, digest=whole)))
    with pytest.raises(InvalidCheckpointState, match="digest mismatch"):
        read(tmp_path)


def test_without_a_frame_index_the_digest_is_still_the_frames_and_recommits_compare_it(
    tmp_path: pathlib.Path,
) -> None:
    recs = records()
    first = write(tmp_path, recs, frame_index=False)
    assert first.frames == []
    assert first.digest_algo == "sha256-frames"
    assert write(tmp_path, recs, frame_index=False) == first
    with pytest.raises(InvalidCheckpointState, match="different commit"):
        write(tmp_path, records(tag="x"), frame_index=False)
    assert [r.state for r in read(tmp_path)] == [r.state for r in recs]
