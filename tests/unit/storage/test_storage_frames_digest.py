"""The records file's digest made of its frames' digests ("blake3-frames"):
every byte still verified on restore, a corrupt or torn file refused whole,
checkpoints written with the frames' sha256 ("sha256-frames") or the
whole-file digest ("sha256") still read."""

from __future__ import annotations

import hashlib
import pathlib
from typing import Any

import blake3
import msgspec
import pytest

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage import (
    ParticipantManifest,
    participant_dir,
    read_participant,
    write_participant,
)
from ray_ckpt.storage.participant.manifest_shapes import verify_participant
from ray_ckpt.storage.participant.participant_manifest import MANIFEST_NAME, decode_manifest
from ray_ckpt.storage.participant.participant_store import encode_manifest
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.records.records_format import FRAME, MAGIC
from ray_ckpt.storage.records.records_io import records_digest

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
    assert m.digest_algo == "blake3-frames"
    assert records_digest([data]) == m.digest
    # Cut anywhere between chunks: the same digest.
    assert records_digest([data[:5], data[5:1000], data[1000:]]) == m.digest
    assert m.digest != blake3.blake3(data).hexdigest()


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
    data = rpath.read_bytes()
    old = msgspec.structs.replace(
        m,
        digest_algo="sha256",
        digest=hashlib.sha256(data).hexdigest(),
        # Its frame index, if any, held the frames' sha256.
        frames=[
            msgspec.structs.replace(
                f, digest=hashlib.sha256(data[f.offset : f.offset + f.length]).hexdigest()
            )
            for f in m.frames
        ],
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
    assert first.digest_algo == "blake3-frames"
    assert write(tmp_path, recs, frame_index=False) == first
    with pytest.raises(InvalidCheckpointState, match="different commit"):
        write(tmp_path, records(tag="x"), frame_index=False)
    assert [r.state for r in read(tmp_path)] == [r.state for r in recs]


def as_sha256_frames(d: pathlib.Path) -> ParticipantManifest:
    """Rewrite the manifest as the code before BLAKE3 wrote it: the frames'
    sha256 digests, and the file's made of them."""
    mpath, rpath = files(d)
    m = decode_manifest(mpath.read_bytes(), "m")
    data = rpath.read_bytes()
    raw = [hashlib.sha256(data[f.offset : f.offset + f.length]).digest() for f in m.frames]
    old = msgspec.structs.replace(
        m,
        digest_algo="sha256-frames",
        digest=hashlib.sha256(MAGIC + b"".join(raw)).hexdigest(),
        frames=[msgspec.structs.replace(f, digest=r.hex()) for f, r in zip(m.frames, raw)],
    )
    mpath.write_bytes(encode_manifest(old))
    return old


def test_a_checkpoint_with_sha256_frames_still_restores_recommits_and_is_verified(
    tmp_path: pathlib.Path,
) -> None:
    recs = records()
    write(tmp_path, recs)
    old = as_sha256_frames(tmp_path)
    assert [r.state for r in read(tmp_path)] == [r.state for r in recs]
    verify_participant(tmp_path, KIND, INST, checkpoint_id="c1")
    assert write(tmp_path, recs) == old  # the recommit hashes as it was written
    with pytest.raises(InvalidCheckpointState, match="different commit"):
        write(tmp_path, records(tag="x"))
    _, rpath = files(tmp_path)
    data = bytearray(rpath.read_bytes())
    data[-2] ^= 0x40
    rpath.write_bytes(bytes(data))
    with pytest.raises(InvalidCheckpointState, match="digest mismatch"):
        read(tmp_path, only="r0")


def test_an_incremental_checkpoint_after_a_sha256_one_starts_a_full_chain(
    tmp_path: pathlib.Path,
) -> None:
    """References are in their manifest's own digest: a BLAKE3 manifest
    never points at frames hashed with sha256."""
    from ray_ckpt.storage.participant.incremental import Previous

    recs = records()
    first = tmp_path / "ck-1"
    write(first, recs)
    old = as_sha256_frames(first)
    second = tmp_path / "ck-2"
    m = write_participant(
        second,
        kind=KIND,
        instance=INST,
        checkpoint_id="c2",
        records=recs,
        previous=Previous(location=str(first), manifest=old),
    )
    assert m.refs == []
    assert m.chain_depth == 0
    assert m.digest_algo == "blake3-frames"
    # ... and the next one, over a BLAKE3 base, references again.
    third = write_participant(
        tmp_path / "ck-3",
        kind=KIND,
        instance=INST,
        checkpoint_id="c3",
        records=recs,
        previous=Previous(location=str(second), manifest=m),
    )
    assert len(third.refs) == len(recs)
    got = read_participant(tmp_path / "ck-3", kind=KIND, instance=INST, checkpoint_id="c3")[1]
    assert [r.state for r in got] == [r.state for r in recs]
