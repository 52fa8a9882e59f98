"""Attachment blobs under retention and in the listing, on local disk and on S3.

A checkpoint's bytes count the blobs it holds; retention keeps every blob a
kept checkpoint (or one in flight) references, whichever folder holds it,
and deletes the rest of a deleted checkpoint's; a referenced blob that is
gone makes the checkpoint that needs it incomplete.
"""

from __future__ import annotations

import pathlib

import blake3

from ray_ckpt.storage import open_location, read_participant, write_gym_manifest, write_participant
from ray_ckpt.storage.blobstore.blobs import is_temp
from ray_ckpt.storage.blobstore.locations import join_location
from ray_ckpt.storage.participant.incremental import Previous
from ray_ckpt.storage.participant.participant_manifest import ParticipantManifest, participant_key
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.root.catalog import scan
from ray_ckpt.storage.root.retention import collect
from tests.s3_server import local_or_s3_root, s3_endpoint

__all__ = ["local_or_s3_root", "s3_endpoint"]  # the fixtures, imported for pytest

KIND, INST = "sandbox", "sb0"
PKEY = participant_key(KIND, INST)
SIZE = 3000


class Box:
    """A sandbox of ten files (one record), written checkpoint after checkpoint."""

    def __init__(self, root: str, src: pathlib.Path) -> None:
        self.root = root
        self.src = src
        src.mkdir(parents=True, exist_ok=True)
        self.gens = [0] * 10

    def digest(self, i: int, gen: int) -> str:
        data = (f"file {i} gen {gen} ".encode() * SIZE)[:SIZE]
        digest = blake3.blake3(data).hexdigest()
        (self.src / digest).write_bytes(data)
        return digest

    def record(self) -> Record:
        digests = [self.digest(i, g) for i, g in enumerate(self.gens)]
        return Record(
            "ep-0", {"snapshot": digests}, attachments={d: str(self.src / d) for d in digests}
        )

    def commit(
        self, name: str, previous: tuple[str, ParticipantManifest] | None, *, complete: bool = True
    ) -> tuple[str, ParticipantManifest]:
        where = join_location(self.root, name)
        m = write_participant(
            where,
            kind=KIND,
            instance=INST,
            checkpoint_id=name,
            records=[self.record()],
            previous=Previous(*previous) if previous else None,
        )
        if complete:
            write_gym_manifest(where, checkpoint_id=name, manifests=[m])
        return where, m


def blob_names(root: str, name: str) -> set[str]:
    listed = open_location(root).list(f"{name}/{PKEY}/blobs")
    return {i.key.rpartition("/")[2] for i in listed if not is_temp(i.key)}


def test_bytes_count_own_blobs_and_gc_keeps_referenced_ones(
    root: str, tmp_path: pathlib.Path
) -> None:
    box = Box(root, tmp_path / "src")
    c0 = box.commit("c0", None)
    box.gens[3] = 1
    c1 = box.commit("c1", c0)
    rows = {e.name: e for e in scan(open_location(root)).entries}
    assert rows["c0"].bytes == c0[1].bytes + 10 * SIZE
    assert rows["c1"].bytes == c1[1].bytes + SIZE
    assert rows["c0"].referenced_by == ["c1"]

    plan = collect(open_location(root), 1)
    assert plan.deleted_checkpoints == ["c0"]
    # c0's blobs that c1 references stay; the one file c1 changed goes.
    left = blob_names(root, "c0")
    assert left == {box.digest(i, 0) for i in range(10) if i != 3}
    assert f"c0/{PKEY}/manifest.json" not in {i.key for i in open_location(root).list("c0")}
    _, got = read_participant(
        c1[0], kind=KIND, instance=INST, checkpoint_id="c1", attachments_dir=str(tmp_path)
    )
    assert len(got[0].attachments or {}) == 10
    # What stays of c0 lists as an incomplete leftover, never as restorable.
    assert {e.name: e.complete for e in scan(open_location(root)).entries} == {
        "c0": False,
        "c1": True,
    }


def test_a_referenced_blob_gone_makes_the_checkpoint_incomplete(
    root: str, tmp_path: pathlib.Path
) -> None:
    box = Box(root, tmp_path / "src")
    c0 = box.commit("c0", None)
    box.gens[0] = 1
    box.commit("c1", c0)
    open_location(root).delete([f"c0/{PKEY}/blobs/{box.digest(5, 0)}"])
    rows = {e.name: e for e in scan(open_location(root)).entries}
    assert rows["c1"].complete is False
    assert rows["c0"].complete is False  # its own blob is gone too


def test_an_in_flight_checkpoint_keeps_the_blobs_it_references(
    root: str, tmp_path: pathlib.Path
) -> None:
    box = Box(root, tmp_path / "src")
    c0 = box.commit("c0", None)
    box.gens = [9] * 10
    box.commit("c1", None)  # complete, shares nothing with c0
    box.gens = [0] * 10
    box.gens[0] = 2
    # Participant manifest written, Gym manifest not yet: in flight, it
    # references nine of c0's blobs.
    _, m2 = box.commit("c2", c0, complete=False)
    assert sum(r.checkpoint == "c0" for r in m2.blobs) == 9
    plan = collect(open_location(root), 1)
    assert plan.deleted_checkpoints == ["c0"]
    assert blob_names(root, "c0") == {box.digest(i, 0) for i in range(1, 10)}
