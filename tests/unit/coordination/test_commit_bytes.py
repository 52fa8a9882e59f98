"""A commit's bytes, as the coordinator reports them: each participant's
records object as the Gym manifest measured it, plus the attachment blobs
the checkpoint holds itself (referenced ones count where they were written)."""

from __future__ import annotations

import pathlib

import blake3
import msgspec

from coordination.engine.coordinator_core import manifest_bytes
from ray_ckpt.storage import write_gym_manifest, write_participant
from ray_ckpt.storage.participant.incremental import Previous
from ray_ckpt.storage.records.record import Record


def files(folder: pathlib.Path, n: int, gen: int) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for i in range(n):
        data = f"file {i} gen {gen if i == 0 else 0} ".encode() * 100
        digest = blake3.blake3(data).hexdigest()
        (folder / digest).write_bytes(data)
        out[digest] = str(folder / digest)
    return out


def test_a_commits_bytes_count_the_blobs_it_holds(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "src"
    previous = None
    sizes = []
    for gen in range(2):
        where = tmp_path / f"c{gen}"
        attached = files(src, 4, gen)
        m = write_participant(
            where,
            kind="sandbox",
            instance="s0",
            checkpoint_id=f"c{gen}",
            records=[Record("ep", sorted(attached), attachments=attached)],
            previous=previous,
        )
        listed = write_gym_manifest(where, checkpoint_id=f"c{gen}", manifests=[m])
        previous = Previous(str(where), m)
        reply = msgspec.to_builtins(m)
        assert manifest_bytes(reply, listed) == listed.participants[0].bytes + m.blob_bytes
        assert manifest_bytes(reply) == m.bytes + m.blob_bytes
        sizes.append(m.blob_bytes)
    one = len("file 0 gen 0 ") * 100
    assert sizes == [4 * one, one]  # the second writes the one changed file


def test_without_attachments_the_bytes_are_the_records_alone(tmp_path: pathlib.Path) -> None:
    m = write_participant(
        tmp_path / "c", kind="agent", instance="a0", checkpoint_id="c", records=[Record("r", 1)]
    )
    listed = write_gym_manifest(tmp_path / "c", checkpoint_id="c", manifests=[m])
    assert manifest_bytes(msgspec.to_builtins(m), listed) == listed.participants[0].bytes == m.bytes
