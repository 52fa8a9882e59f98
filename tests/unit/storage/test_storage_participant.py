"""Participant records and manifests: round trip, manifest rules, validation."""

from __future__ import annotations

import hashlib
import math
import pathlib
import re
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
from ray_ckpt.storage.participant.participant_store import encode_manifest
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.records.records_format import FRAME, MAGIC

KIND, INST = "environment", "env-0"


def records(n: int = 5, big: int = 0) -> list[Record]:
    return [
        Record(
            f"r{i}" if i % 2 else f"r{i}-a2",
            {"z": i, "a": [math.nan, -0.0, math.inf], "blob": b"\x00" * big, "t": "é" * 10},
        )
        for i in range(n)
    ]


def write(
    d: pathlib.Path, recs: list[Record] | None = None, cid: str = "c1"
) -> ParticipantManifest:
    return write_participant(
        d, kind=KIND, instance=INST, checkpoint_id=cid, records=recs or records()
    )


def read(d: pathlib.Path, cid: str | None = "c1", **kw: Any) -> tuple[Any, list[Record]]:
    return read_participant(d, kind=KIND, instance=INST, checkpoint_id=cid, **kw)


def pdir(d: pathlib.Path) -> pathlib.Path:
    return participant_dir(d, KIND, INST)


def test_round_trip_keeps_order_and_manifest_describes_the_file(tmp_path: pathlib.Path) -> None:
    recs = records()
    m = write(tmp_path, recs)
    got_m, got = read(tmp_path)
    assert got_m == m
    assert [r.key for r in got] == [r.key for r in recs]
    assert msgspec.msgpack.encode(got) == msgspec.msgpack.encode(recs)
    path = pdir(tmp_path) / m.records_file
    # Named by a fresh token (fixed before a multipart upload starts); the
    # manifest keeps the digest.
    assert re.fullmatch(r"records-[0-9a-f]{32}\.msgpack", m.records_file)
    # The digest is made of the frames' own BLAKE3 digests, after the magic.
    data = path.read_bytes()
    assert m.digest_algo == "blake3-frames"
    assert [f.digest for f in m.frames] == [
        blake3.blake3(data[f.offset : f.offset + f.length]).hexdigest() for f in m.frames
    ]
    assert data[: len(MAGIC)] == MAGIC
    assert sum(f.length for f in m.frames) == len(data) - len(MAGIC)
    listed = b"".join(bytes.fromhex(f.digest) for f in m.frames)
    assert blake3.blake3(MAGIC + listed).hexdigest() == m.digest
    assert path.stat().st_size == m.bytes
    assert m.episodes == sorted(r.key for r in recs)
    assert m.record_count == 5
    assert sorted(p.name for p in pdir(tmp_path).iterdir()) == sorted(
        ["manifest.json", m.records_file]
    )


def test_a_restored_state_re_exports_byte_for_byte(tmp_path: pathlib.Path) -> None:
    m1 = write(tmp_path / "a")
    _, got = read(tmp_path / "a")
    m2 = write(tmp_path / "b", got)
    a = (pdir(tmp_path / "a") / m1.records_file).read_bytes()
    b = (pdir(tmp_path / "b") / m2.records_file).read_bytes()
    assert a == b


def test_large_states_stream_through_several_chunks(tmp_path: pathlib.Path) -> None:
    recs = records(n=6, big=3 << 20)  # 18 MB over 4 MB chunks, records span chunks
    m = write(tmp_path, recs)
    _, got = read(tmp_path)
    assert m.bytes > 18 << 20
    assert [r.state["blob"] for r in got] == [r.state["blob"] for r in recs]


def test_select_keeps_only_in_scope_records(tmp_path: pathlib.Path) -> None:
    write(tmp_path)
    _, got = read(tmp_path, select=lambda k: k in {"r1", "r3"})
    assert [r.key for r in got] == ["r1", "r3"]


def test_select_does_not_hide_corruption_outside_the_scope(tmp_path: pathlib.Path) -> None:
    m = write(tmp_path)
    path = pdir(tmp_path) / m.records_file
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # inside the last record's state
    path.write_bytes(bytes(data))
    with pytest.raises(InvalidCheckpointState, match="digest"):
        read(tmp_path, select=lambda k: k == "r1")


def test_identical_recommit_returns_the_existing_manifest(tmp_path: pathlib.Path) -> None:
    m1 = write(tmp_path)
    before = (pdir(tmp_path) / "manifest.json").stat().st_mtime_ns
    assert write(tmp_path) == m1
    assert (pdir(tmp_path) / "manifest.json").stat().st_mtime_ns == before


def test_a_different_commit_never_replaces_the_manifest(tmp_path: pathlib.Path) -> None:
    m1 = write(tmp_path)
    other = records()[:3]
    with pytest.raises(InvalidCheckpointState, match="never replaced") as err:
        write(tmp_path, other)
    assert err.value.http_status == 422
    with pytest.raises(InvalidCheckpointState, match="never replaced"):
        write(tmp_path, cid="c2")
    got_m, _ = read(tmp_path)
    assert got_m == m1
    # The loser's records file is not left behind.
    assert sorted(p.name for p in pdir(tmp_path).iterdir()) == sorted(
        ["manifest.json", m1.records_file]
    )


def test_empty_participant_round_trips(tmp_path: pathlib.Path) -> None:
    m = write_participant(tmp_path, kind=KIND, instance=INST, checkpoint_id="c1", records=[])
    assert m.record_count == 0
    assert read(tmp_path)[1] == []


@pytest.mark.parametrize("name", ["", "..", ".hidden", "a/b", "../x", "x\x00", "-a", "a b"])
def test_names_that_could_escape_the_directory_are_refused(
    tmp_path: pathlib.Path, name: str
) -> None:
    with pytest.raises(InvalidCheckpointState, match="name"):
        participant_dir(tmp_path, name, INST)
    with pytest.raises(InvalidCheckpointState, match="name"):
        write_participant(tmp_path, kind=KIND, instance=name, checkpoint_id="c", records=[])
    with pytest.raises(InvalidCheckpointState, match="name"):
        read_participant(tmp_path, kind=name, instance=INST, checkpoint_id=None)
    assert list(tmp_path.iterdir()) == []


def test_bad_records_are_refused_at_write_naming_the_episode(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidCheckpointState, match="episode r7: cannot store"):
        write(tmp_path, [Record("r7", {"x": object()})])
    with pytest.raises(InvalidCheckpointState, match="bad key"):
        write(tmp_path, [Record("bad key", 1)])
    with pytest.raises(InvalidCheckpointState, match="repeat"):
        write(tmp_path, [Record("r1", 1), Record("r1", 2)])
    assert not (pdir(tmp_path) / "manifest.json").exists()
    assert list(pdir(tmp_path).iterdir()) == []


# --- restore validation: each a typed error naming its cause --------------------------


def rewrite_manifest(d: pathlib.Path, **changes: Any) -> None:
    path = pdir(d) / "manifest.json"
    raw = msgspec.json.decode(path.read_bytes())
    raw.update(changes)
    path.write_bytes(msgspec.json.encode(raw))


def test_missing_manifest(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidCheckpointState, match="missing manifest"):
        read(tmp_path)


def test_manifest_for_another_checkpoint(tmp_path: pathlib.Path) -> None:
    write(tmp_path)
    with pytest.raises(InvalidCheckpointState, match="for checkpoint 'c1', not 'c9'"):
        read(tmp_path, cid="c9")


def test_manifest_for_another_participant(tmp_path: pathlib.Path) -> None:
    write(tmp_path)
    other = participant_dir(tmp_path, KIND, "env-1")
    other.mkdir()
    (other / "manifest.json").write_bytes((pdir(tmp_path) / "manifest.json").read_bytes())
    with pytest.raises(InvalidCheckpointState, match="is for environment/env-0"):
        read_participant(tmp_path, kind=KIND, instance="env-1", checkpoint_id="c1")


@pytest.mark.parametrize(
    ("changes", "cause"),
    [
        ({"schema_version": 2}, "unknown manifest schema version 2"),
        ({"format": "jsonl/9"}, "unknown records format"),
        ({"digest_algo": "md5"}, "unknown digest"),
        ({"records_file": "../../../etc/passwd"}, "bad records file name"),
        ({"record_count": "many"}, "corrupt manifest"),
        ({"records_file": "records-" + "0" * 64 + ".msgpack"}, "is missing"),
    ],
)
def test_bad_manifest_fields(tmp_path: pathlib.Path, changes: dict[str, Any], cause: str) -> None:
    write(tmp_path)
    rewrite_manifest(tmp_path, **changes)
    with pytest.raises(InvalidCheckpointState, match=cause):
        read(tmp_path)


def test_manifest_that_is_not_json(tmp_path: pathlib.Path) -> None:
    write(tmp_path)
    (pdir(tmp_path) / "manifest.json").write_bytes(b'{"schema_version": 1, "kin')
    with pytest.raises(InvalidCheckpointState, match="corrupt manifest"):
        read(tmp_path)


def test_digest_mismatch(tmp_path: pathlib.Path) -> None:
    m = write(tmp_path)
    path = pdir(tmp_path) / m.records_file
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(InvalidCheckpointState, match="digest mismatch"):
        read(tmp_path)


@pytest.mark.parametrize("cut", [1, 5, 40])
def test_truncated_records(tmp_path: pathlib.Path, cut: int) -> None:
    m = write(tmp_path)
    path = pdir(tmp_path) / m.records_file
    path.write_bytes(path.read_bytes()[:-cut])
    with pytest.raises(InvalidCheckpointState, match="truncated"):
        read(tmp_path)


def forge(d: pathlib.Path, body: bytes, count: int, episodes: list[str]) -> None:
    """A records file whose manifest matches it byte for byte, so only parsing can object."""
    digest = hashlib.sha256(body).hexdigest()
    pd = pdir(d)
    pd.mkdir(parents=True)
    (pd / f"records-{digest}.msgpack").write_bytes(body)
    m = ParticipantManifest(
        schema_version=1,
        checkpoint_id="c1",
        kind=KIND,
        instance=INST,
        records_file=f"records-{digest}.msgpack",
        digest_algo="sha256",
        digest=digest,
        record_count=count,
        episodes=episodes,
        bytes=len(body),
        format="msgpack-frames/1",
    )
    (pd / "manifest.json").write_bytes(encode_manifest(m))


def test_corrupt_record_with_a_matching_digest(tmp_path: pathlib.Path) -> None:
    forge(tmp_path, MAGIC + FRAME.pack(2, 3) + b"r1" + b"\xc1\xc1\xc1", 1, ["r1"])
    with pytest.raises(InvalidCheckpointState, match=r"corrupt records .*record r1"):
        read(tmp_path)


def test_corrupt_header_and_key(tmp_path: pathlib.Path) -> None:
    forge(tmp_path / "a", b"NOTMAGIC" + FRAME.pack(2, 1) + b"r1\xc0", 1, ["r1"])
    with pytest.raises(InvalidCheckpointState, match="bad file header"):
        read(tmp_path / "a")
    forge(tmp_path / "b", MAGIC + FRAME.pack(2, 1) + b"\xff\xfe\xc0", 1, ["r1"])
    with pytest.raises(InvalidCheckpointState, match="bad capture key"):
        read(tmp_path / "b")
    forge(tmp_path / "c", MAGIC + FRAME.pack(2, 99) + b"r1\xc0", 1, ["r1"])
    with pytest.raises(InvalidCheckpointState, match="truncated record"):
        read(tmp_path / "c")


def test_count_or_episodes_that_disagree_with_the_manifest(tmp_path: pathlib.Path) -> None:
    body = MAGIC + FRAME.pack(2, 1) + b"r1\xc0"
    forge(tmp_path / "a", body, 2, ["r1", "r2"])
    with pytest.raises(InvalidCheckpointState, match="manifest lists 2"):
        read(tmp_path / "a")
    forge(tmp_path / "b", body, 1, ["r9"])
    with pytest.raises(InvalidCheckpointState, match="episodes"):
        read(tmp_path / "b")
