"""Attachments (`Record.attachments`) on local disk and on S3 (moto over HTTP).

Each distinct digest is stored once as ``gym/<kind>/<instance>/blobs/<digest>``
before the manifest, verified as it streams; a read hands back verified
local files (the objects themselves on disk, downloads from a store) for
the kept records only, and fails whole on any bad blob; an incremental
checkpoint references the blobs its base stores; a manifest without
attachments is what it always was.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import blake3
import msgspec
import pytest

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage import (
    open_location,
    read_participant,
    verify_checkpoint,
    write_gym_manifest,
    write_participant,
)
from ray_ckpt.storage.blobstore.blobs import Blobs, is_temp
from ray_ckpt.storage.blobstore.locations import join_location
from ray_ckpt.storage.participant.incremental import ChainPolicy, Previous
from ray_ckpt.storage.participant.participant_manifest import (
    BlobRef,
    ParticipantManifest,
    decode_manifest,
    encode_manifest,
    participant_key,
)
from ray_ckpt.storage.records.record import Record
from tests.s3_server import local_or_s3_root, s3_endpoint

__all__ = ["local_or_s3_root", "s3_endpoint"]  # the fixtures, imported for pytest

KIND, INST = "sandbox", "sb0"
PKEY = participant_key(KIND, INST)


class Files:
    """Content files in a scratch folder, named by their BLAKE3 digest."""

    def __init__(self, folder: pathlib.Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, data: bytes) -> str:
        digest = blake3.blake3(data).hexdigest()
        (self.folder / digest).write_bytes(data)
        return digest

    def path(self, digest: str) -> str:
        return str(self.folder / digest)

    def attachments(self, *digests: str) -> dict[str, str]:
        return {d: self.path(d) for d in digests}


def content(i: int, gen: int = 0, size: int = 3000) -> bytes:
    return (f"file {i} generation {gen} ".encode() * size)[:size]


def write(
    location: str,
    cid: str,
    records: list[Record],
    previous: tuple[str, ParticipantManifest] | None = None,
    **kw: Any,
) -> ParticipantManifest:
    m = write_participant(
        location,
        kind=KIND,
        instance=INST,
        checkpoint_id=cid,
        records=records,
        previous=Previous(*previous) if previous else None,
        **kw,
    )
    write_gym_manifest(location, checkpoint_id=cid, manifests=[m])
    return m


def blob_keys(blobs: Blobs, prefix: str = "") -> list[str]:
    folder = f"{prefix}{PKEY}/blobs"
    return [i.key for i in blobs.list(folder) if not is_temp(i.key)]


def flip(blobs: Blobs, key: str) -> None:
    data = bytearray(blobs.read(key))
    data[len(data) // 2] ^= 0xFF
    blobs.replace(key, bytes(data))


def test_round_trip_stores_each_digest_once_and_reads_verified_files(
    root: str, tmp_path: pathlib.Path
) -> None:
    files = Files(tmp_path / "src")
    shared, a, b = files.add(b"shared" * 1000), files.add(content(1)), files.add(b"")
    records = [
        Record("r0", {"snapshot": [shared, a]}, attachments=files.attachments(shared, a)),
        Record("r1", {"snapshot": [shared, b]}, attachments=files.attachments(shared, b)),
        Record("r2", {"plain": True}),
    ]
    where = join_location(root, "c1")
    m = write(where, "c1", records)
    blobs = open_location(where)
    assert sorted(blob_keys(blobs)) == sorted(f"{PKEY}/blobs/{d}" for d in (shared, a, b))
    assert m.attachments == {"r0": sorted([shared, a]), "r1": sorted([shared, b])}
    assert [r.digest for r in m.blobs] == sorted([shared, a, b])
    assert {r.checkpoint for r in m.blobs} == {"c1"}
    assert m.blob_bytes == 6000 + 3000 + 0
    assert verify_checkpoint(where).ok

    out = tmp_path / "restore"
    out.mkdir()
    _, got = read_participant(
        where, kind=KIND, instance=INST, checkpoint_id="c1", attachments_dir=str(out)
    )
    assert [(r.key, r.state) for r in got] == [(r.key, r.state) for r in records]
    assert got[2].attachments is None
    for r, want in zip(got, records, strict=True):
        for digest, path in (r.attachments or {}).items():
            assert pathlib.Path(path).read_bytes() == pathlib.Path(files.path(digest)).read_bytes()
        assert sorted(r.attachments or {}) == sorted(want.attachments or {})
    paths = {p for r in got for p in (r.attachments or {}).values()}
    if root.startswith("s3://"):
        assert {pathlib.Path(p).parent for p in paths} == {out}
    else:
        # On disk: the blob objects themselves, nothing copied.
        assert paths == {str(pathlib.Path(where, PKEY, "blobs", d)) for d in (shared, a, b)}
        assert not list(out.iterdir())


def test_only_the_kept_records_blobs_are_fetched(root: str, tmp_path: pathlib.Path) -> None:
    files = Files(tmp_path / "src")
    digests = [files.add(content(i)) for i in range(3)]
    records = [
        Record(f"r{i}", {"i": i}, attachments=files.attachments(d)) for i, d in enumerate(digests)
    ]
    where = join_location(root, "c1")
    write(where, "c1", records)
    flip(open_location(where), f"{PKEY}/blobs/{digests[2]}")  # never read: not kept
    out = tmp_path / "restore"
    out.mkdir()
    _, got = read_participant(
        where,
        kind=KIND,
        instance=INST,
        checkpoint_id="c1",
        select=lambda key: key == "r1",
        attachments_dir=str(out),
    )
    assert [(r.key, sorted(r.attachments or {})) for r in got] == [("r1", [digests[1]])]
    if root.startswith("s3://"):
        assert sorted(p.name for p in out.iterdir()) == [digests[1]]


def test_a_remote_read_without_a_folder_makes_one_the_caller_owns(
    root: str, tmp_path: pathlib.Path
) -> None:
    files = Files(tmp_path / "src")
    d = files.add(content(7))
    where = join_location(root, "c1")
    write(where, "c1", [Record("r0", 1, attachments=files.attachments(d))])
    _, got = read_participant(where, kind=KIND, instance=INST, checkpoint_id="c1")
    path = pathlib.Path((got[0].attachments or {})[d])
    assert path.read_bytes() == content(7)
    if root.startswith("s3://"):
        assert path.parent.name.startswith("ray-ckpt-attachments-")
        for f in path.parent.iterdir():
            f.unlink()
        path.parent.rmdir()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_blob_fails_the_read_whole(
    root: str, tmp_path: pathlib.Path, damage: str
) -> None:
    files = Files(tmp_path / "src")
    good, bad = files.add(content(1)), files.add(content(2))
    where = join_location(root, "c1")
    write(
        where,
        "c1",
        [
            Record("r0", 0, attachments=files.attachments(good)),
            Record("r1", 1, attachments=files.attachments(bad)),
        ],
    )
    blobs = open_location(where)
    key = f"{PKEY}/blobs/{bad}"
    if damage == "flip":
        flip(blobs, key)
    elif damage == "truncate":
        blobs.replace(key, blobs.read(key)[:-1])
    else:
        blobs.delete([key])
    out = tmp_path / "restore"
    out.mkdir()
    got: list[Record] | None = None
    with pytest.raises(InvalidCheckpointState, match=bad[:16]):
        _, got = read_participant(
            where, kind=KIND, instance=INST, checkpoint_id="c1", attachments_dir=str(out)
        )
    assert got is None
    # All or nothing: the good blob's download went with the failure.
    assert not list(out.iterdir())
    report = verify_checkpoint(where)
    assert not report.ok
    assert bad[:16] in (report.participants[0].error or "")


def test_a_source_that_does_not_match_its_digest_publishes_nothing(
    root: str, tmp_path: pathlib.Path
) -> None:
    files = Files(tmp_path / "src")
    good, lying = files.add(content(1)), files.add(content(2))
    pathlib.Path(files.path(lying)).write_bytes(content(3))  # not what its name says
    where = join_location(root, "c1")
    with pytest.raises(InvalidCheckpointState, match="does not match its digest"):
        write_participant(
            where,
            kind=KIND,
            instance=INST,
            checkpoint_id="c1",
            records=[
                Record("r0", 0, attachments=files.attachments(good)),
                Record("r1", 1, attachments=files.attachments(lying)),
            ],
        )
    blobs = open_location(where)
    names = [i.key.rpartition("/")[2] for i in blobs.list() if not is_temp(i.key)]
    assert "manifest.json" not in names
    assert lying not in names
    assert not [n for n in names if n.startswith("records-")]


def test_a_retry_keeps_the_blobs_a_failed_write_stored(root: str, tmp_path: pathlib.Path) -> None:
    """Create-only by content: a blob already stored under its digest (what a
    failed attempt leaves), at the source's size, is kept as it is and listed
    as this checkpoint's own."""
    files = Files(tmp_path / "src")
    good, other = files.add(content(1)), files.add(content(2))
    where = join_location(root, "c1")
    blobs = open_location(where)
    key = f"{PKEY}/blobs/{good}"
    assert blobs.create(key, content(1)) is None
    before = blobs.info(key)
    records = [
        Record("r0", 0, attachments=files.attachments(good)),
        Record("r1", 1, attachments=files.attachments(other)),
    ]
    m = write(where, "c1", records)
    assert blobs.info(key) == before
    assert {(r.digest, r.checkpoint) for r in m.blobs} == {(good, "c1"), (other, "c1")}
    assert m.blob_bytes == 2 * 3000
    assert verify_checkpoint(where).ok


@pytest.mark.parametrize(
    "attachments",
    [{"not-a-digest": "/x"}, {"A" * 64: "/x"}, {"a" * 64: ""}],
    ids=["short", "upper", "no-path"],
)
def test_bad_attachments_are_refused_naming_the_episode(
    tmp_path: pathlib.Path, attachments: dict[str, str]
) -> None:
    with pytest.raises(InvalidCheckpointState, match="episode r0"):
        write_participant(
            str(tmp_path / "c1"),
            kind=KIND,
            instance=INST,
            checkpoint_id="c1",
            records=[Record("r0", 0, attachments=attachments)],
        )


def test_a_missing_source_fails_the_write(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidCheckpointState, match="cannot be read"):
        write_participant(
            str(tmp_path / "c1"),
            kind=KIND,
            instance=INST,
            checkpoint_id="c1",
            records=[Record("r0", 0, attachments={"a" * 64: str(tmp_path / "gone")})],
        )
    assert not (tmp_path / "c1" / PKEY / "manifest.json").exists()


def test_a_manifest_without_attachments_is_what_it_was(tmp_path: pathlib.Path) -> None:
    m = write_participant(
        str(tmp_path / "c1"),
        kind=KIND,
        instance=INST,
        checkpoint_id="c1",
        records=[Record("r0", {"a": 1}, "v1"), Record("r1", {"b": 2})],
    )
    data = (tmp_path / "c1" / PKEY / "manifest.json").read_bytes()
    fields = set(msgspec.json.decode(data))
    assert fields == {
        "schema_version",
        "checkpoint_id",
        "kind",
        "instance",
        "records_file",
        "digest_algo",
        "digest",
        "record_count",
        "episodes",
        "bytes",
        "format",
        "frames",
    }
    # Frames keep their five elements, a version of None included.
    assert [len(f) for f in msgspec.json.decode(data)["frames"]] == [5, 5]
    assert encode_manifest(decode_manifest(data, "here")) == data
    assert decode_manifest(data, "here") == m


@pytest.mark.parametrize(
    "blob",
    [
        ["..", "a" * 64, 1],
        ["c0/../x", "a" * 64, 1],
        ["c0", "a" * 63, 1],
        ["c0", "../" + "a" * 61, 1],
        ["c0", "a" * 64, -1],
    ],
)
def test_a_manifest_whose_blobs_could_point_anywhere_is_refused(
    tmp_path: pathlib.Path, blob: list[Any]
) -> None:
    files = Files(tmp_path / "src")
    d = files.add(b"x")
    m = write_participant(
        str(tmp_path / "c1"),
        kind=KIND,
        instance=INST,
        checkpoint_id="c1",
        records=[Record("r0", 0, attachments=files.attachments(d))],
    )
    raw = msgspec.to_builtins(m)
    raw["blobs"] = [blob]
    raw["attachments"] = {"r0": [blob[1]]}
    with pytest.raises(InvalidCheckpointState, match="bad blob"):
        decode_manifest(msgspec.json.encode(raw), "here")
    raw["blobs"] = [["c1", "b" * 64, 1]]  # fine itself, but r0's digest is not listed
    with pytest.raises(InvalidCheckpointState, match="not a listed blob"):
        decode_manifest(msgspec.json.encode(raw), "here")


def test_a_recommit_returns_the_manifest_and_a_different_one_is_refused(
    tmp_path: pathlib.Path,
) -> None:
    files = Files(tmp_path / "src")
    a, b = files.add(content(1)), files.add(content(2))
    where = str(tmp_path / "c1")

    def commit(digest: str) -> ParticipantManifest:
        return write_participant(
            where,
            kind=KIND,
            instance=INST,
            checkpoint_id="c1",
            records=[Record("r0", {"s": 1}, attachments=files.attachments(digest))],
        )

    first = commit(a)
    assert commit(a) == first
    with pytest.raises(InvalidCheckpointState, match="different commit"):
        commit(b)


# --- incremental ---------------------------------------------------------------


class Sandbox:
    """Ten files; a record per episode whose state lists their digests."""

    def __init__(self, files: Files, n: int = 10) -> None:
        self.files = files
        self.gens = [0] * n

    def record(self) -> Record:
        digests = [self.files.add(content(i, g)) for i, g in enumerate(self.gens)]
        return Record("ep-0", {"snapshot": digests}, attachments=self.files.attachments(*digests))


def own_blobs(root: str, name: str) -> set[str]:
    blobs = open_location(root)
    return {k.rpartition("/")[2] for k in blob_keys(blobs, f"{name}/")}


def test_a_changed_file_writes_one_blob_and_references_the_rest(
    root: str, tmp_path: pathlib.Path
) -> None:
    box = Sandbox(Files(tmp_path / "src"))
    # A record of its own that never changes (most of the records file, so
    # worth referencing): referenced by a FrameRef, it still carries its
    # attachment.
    fixed = box.files.add(b"fixed" * 100)
    steady_state = {"steady": "s" * 5000}
    steady = Record("ep-1", steady_state, "v", attachments=box.files.attachments(fixed))
    c0 = join_location(root, "c0")
    m0 = write(c0, "c0", [box.record(), steady])
    assert len(own_blobs(root, "c0")) == 11

    box.gens[3] = 1
    c1 = join_location(root, "c1")
    first = box.record()
    m1 = write(c1, "c1", [first, steady], previous=(c0, m0))
    assert own_blobs(root, "c1") == {box.files.add(content(3, 1))}
    assert m1.chain_depth == 1
    assert [r.key for r in m1.refs] == ["ep-1"]
    held = {r.digest: r.checkpoint for r in m1.blobs}
    assert len(held) == 11
    assert sorted(held.values()).count("c0") == 10
    assert held[box.files.add(content(3, 1))] == "c1"
    assert m1.blob_bytes == 3000
    assert m1.attachments["ep-1"] == [fixed]

    # Flattened: the third references c0's objects as c0's, not through c1.
    box.gens[5] = 2
    c2 = join_location(root, "c2")
    m2 = write(c2, "c2", [box.record(), steady], previous=(c1, m1))
    held2 = {r.digest: r.checkpoint for r in m2.blobs}
    assert held2[box.files.add(content(3, 1))] == "c1"
    assert held2[box.files.add(content(5, 2))] == "c2"
    assert held2[fixed] == "c0"

    out = tmp_path / "restore"
    out.mkdir()
    for where, name in ((c1, "c1"), (c2, "c2")):
        assert verify_checkpoint(where).ok
        _, got = read_participant(
            where, kind=KIND, instance=INST, checkpoint_id=name, attachments_dir=str(out)
        )
        by_key = {r.key: r for r in got}
        assert by_key["ep-1"].state == steady_state
        assert pathlib.Path((by_key["ep-1"].attachments or {})[fixed]).read_bytes() == (
            b"fixed" * 100
        )
        snapshot = by_key["ep-0"].state["snapshot"]
        for digest in snapshot:
            path = (by_key["ep-0"].attachments or {})[digest]
            assert blake3.blake3(pathlib.Path(path).read_bytes()).hexdigest() == digest


def test_a_corrupt_referenced_blob_fails_the_later_checkpoints_read(
    root: str, tmp_path: pathlib.Path
) -> None:
    box = Sandbox(Files(tmp_path / "src"), n=3)
    c0 = join_location(root, "c0")
    m0 = write(c0, "c0", [box.record()])
    box.gens[0] = 1
    c1 = join_location(root, "c1")
    write(c1, "c1", [box.record()], previous=(c0, m0))
    flip(open_location(root), f"c0/{PKEY}/blobs/{box.files.add(content(2, 0))}")
    with pytest.raises(InvalidCheckpointState, match="corrupt"):
        read_participant(
            c1, kind=KIND, instance=INST, checkpoint_id="c1", attachments_dir=str(tmp_path)
        )


def test_a_full_rewrite_writes_every_blob_again(root: str, tmp_path: pathlib.Path) -> None:
    box = Sandbox(Files(tmp_path / "src"))
    policy = ChainPolicy(full_every=2)
    c0 = join_location(root, "c0")
    m0 = write(c0, "c0", [box.record()], policy=policy)
    box.gens[0] = 1
    c1 = join_location(root, "c1")
    m1 = write(c1, "c1", [box.record()], previous=(c0, m0), policy=policy)
    assert len(own_blobs(root, "c1")) == 1
    box.gens[1] = 1
    c2 = join_location(root, "c2")
    m2 = write(c2, "c2", [box.record()], previous=(c1, m1), policy=policy)
    assert m2.chain_depth == 0
    assert len(own_blobs(root, "c2")) == 10
    assert {r.checkpoint for r in m2.blobs} == {"c2"}
    assert m2.blob_bytes == 10 * 3000


def test_a_base_blob_gone_is_written_again(root: str, tmp_path: pathlib.Path) -> None:
    box = Sandbox(Files(tmp_path / "src"), n=3)
    c0 = join_location(root, "c0")
    m0 = write(c0, "c0", [box.record()])
    gone = box.files.add(content(1, 0))
    open_location(root).delete([f"c0/{PKEY}/blobs/{gone}"])
    box.gens[0] = 1
    c1 = join_location(root, "c1")
    m1 = write(c1, "c1", [box.record()], previous=(c0, m0))
    assert {r.digest: r.checkpoint for r in m1.blobs}[gone] == "c1"
    assert gone in own_blobs(root, "c1")
    _, got = read_participant(
        c1, kind=KIND, instance=INST, checkpoint_id="c1", attachments_dir=str(tmp_path)
    )
    assert len(got[0].attachments or {}) == 3


def test_a_sibling_named_like_this_checkpoints_id_is_never_referenced(
    tmp_path: pathlib.Path,
) -> None:
    """Own blobs are listed under the checkpoint's ID: a base folder of that
    name would read as this checkpoint's own, so its blobs are written."""
    box = Sandbox(Files(tmp_path / "src"), n=2)
    root = tmp_path / "root"
    m0 = write(str(root / "x"), "first", [box.record()])
    box.gens[0] = 1
    m1 = write(str(root / "y"), "x", [box.record()], previous=(str(root / "x"), m0))
    assert {r.checkpoint for r in m1.blobs} == {"x"}
    assert len(own_blobs(str(root), "y")) == 2
    _, got = read_participant(root / "y", kind=KIND, instance=INST, checkpoint_id="x")
    for path in (got[0].attachments or {}).values():
        assert pathlib.Path(path).is_relative_to(root / "y")


def test_a_blob_already_stored_with_another_size_is_refused(tmp_path: pathlib.Path) -> None:
    files = Files(tmp_path / "src")
    d = files.add(content(1))
    where = tmp_path / "c1"
    (where / PKEY / "blobs").mkdir(parents=True)
    (where / PKEY / "blobs" / d).write_bytes(b"short")
    with pytest.raises(InvalidCheckpointState, match="never replaced"):
        write_participant(
            str(where),
            kind=KIND,
            instance=INST,
            checkpoint_id="c1",
            records=[Record("r0", 0, attachments=files.attachments(d))],
        )


def test_many_blobs_are_all_durable_and_listed(tmp_path: pathlib.Path) -> None:
    files = Files(tmp_path / "src")
    digests = [files.add(content(i, size=100 + i)) for i in range(40)]
    where = tmp_path / "c1"
    m = write_participant(
        str(where),
        kind=KIND,
        instance=INST,
        checkpoint_id="c1",
        records=[Record("r0", digests, attachments=files.attachments(*digests))],
    )
    assert sorted(os.listdir(where / PKEY / "blobs")) == sorted(digests)
    assert m.blobs == sorted(
        (BlobRef("c1", d, 100 + i) for i, d in enumerate(digests)), key=lambda r: r.digest
    )


def test_a_blob_larger_than_a_part_streams_both_ways(root: str, tmp_path: pathlib.Path) -> None:
    """Past one multipart part on a store (8 MiB), in several read chunks."""
    files = Files(tmp_path / "src")
    big = files.add(os.urandom(9 << 20))
    where = join_location(root, "c1")
    m = write(where, "c1", [Record("r0", 0, attachments=files.attachments(big))])
    assert m.blob_bytes == 9 << 20
    out = tmp_path / "restore"
    out.mkdir()
    _, got = read_participant(
        where, kind=KIND, instance=INST, checkpoint_id="c1", attachments_dir=str(out)
    )
    path = pathlib.Path((got[0].attachments or {})[big])
    assert blake3.blake3(path.read_bytes()).hexdigest() == big
