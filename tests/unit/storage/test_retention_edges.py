"""Retention at its edges, on real files (disk, and S3 on moto over HTTP):
an in-flight incremental checkpoint keeps the earlier files it will need, and
"newest" is the Gym manifest's own time, not the listing's whole second."""

from __future__ import annotations

import pathlib
import time

import msgspec

from ray_ckpt.storage import open_location, read_participant, write_gym_manifest, write_participant
from ray_ckpt.storage.blobstore.blobs import temp_key
from ray_ckpt.storage.blobstore.locations import join_location
from ray_ckpt.storage.participant.incremental import Previous
from ray_ckpt.storage.participant.participant_manifest import ParticipantManifest, participant_key
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.root.catalog import pick_latest, scan
from ray_ckpt.storage.root.gym_manifest import read_gym_manifest
from ray_ckpt.storage.root.retention import collect
from tests.s3_server import local_or_s3_root, s3_endpoint
from tests.unit.storage.catalog_fixtures import date

__all__ = ["local_or_s3_root", "s3_endpoint"]  # the fixtures, imported for pytest

GRACE = 3600.0


def records(gen: int, changed: int = 1) -> list[Record]:
    return [
        Record(f"r{i}", {"i": i, "gen": gen if i < changed else 0, "pad": "x" * 3000}, None)
        for i in range(10)
    ]


def part(
    root: str,
    name: str,
    kind: str,
    recs: list[Record],
    previous: tuple[str, ParticipantManifest] | None = None,
) -> ParticipantManifest:
    return write_participant(
        join_location(root, name),
        kind=kind,
        instance="i0",
        checkpoint_id=f"c-{name}",
        records=recs,
        previous=Previous(*previous) if previous else None,
    )


def left(root: str) -> set[str]:
    return {i.key for i in open_location(root).list()}


def test_an_in_flight_incremental_keeps_the_records_it_references(root: str) -> None:
    # ck-0: agent and env, full.  ck-1 (newer, complete): a full rewrite.
    a0 = part(root, "ck-0", "agent", records(0))
    e0 = part(root, "ck-0", "environment", records(0))
    write_gym_manifest(join_location(root, "ck-0"), checkpoint_id="c-ck-0", manifests=[a0, e0])
    a1 = part(root, "ck-1", "agent", records(1, changed=10))
    e1 = part(root, "ck-1", "environment", records(1, changed=10))
    write_gym_manifest(join_location(root, "ck-1"), checkpoint_id="c-ck-1", manifests=[a1, e1])
    # ck-2 in flight: the agent committed incrementally on ck-0 (its chain's
    # base), the Gym manifest not written yet.
    a2 = part(root, "ck-2", "agent", records(2), previous=(join_location(root, "ck-0"), a0))
    assert a2.refs, "references ck-0's records"
    base = f"ck-0/{participant_key('agent', 'i0')}/{a0.records_file}"
    plan = collect(open_location(root), 1, now=time.time(), grace_s=GRACE)
    assert "ck-0" in plan.deleted_checkpoints
    assert base not in plan.delete
    assert base in left(root)
    # ck-2 completes and restores whole.
    e2 = part(root, "ck-2", "environment", records(2))
    write_gym_manifest(join_location(root, "ck-2"), checkpoint_id="c-ck-2", manifests=[a2, e2])
    _, got = read_participant(
        join_location(root, "ck-2"), kind="agent", instance="i0", checkpoint_id="c-ck-2"
    )
    assert sorted((r.key, r.state) for r in got) == sorted((r.key, r.state) for r in records(2))


def test_a_participant_still_writing_keeps_its_base(root: str) -> None:
    # ck-0 holds the agent; the newer ck-1 does not (it was not registered
    # then), so the agent's next write is based on ck-0 (`storage.seam`).
    a0 = part(root, "ck-0", "agent", records(0))
    write_gym_manifest(join_location(root, "ck-0"), checkpoint_id="c-ck-0", manifests=[a0])
    e1 = part(root, "ck-1", "environment", records(1))
    write_gym_manifest(join_location(root, "ck-1"), checkpoint_id="c-ck-1", manifests=[e1])
    # ck-2 in flight: the agent's records are still being written (a temp
    # object, no manifest yet: its references are not known).
    pdir = f"ck-2/{participant_key('agent', 'i0')}"
    open_location(root).create(temp_key(f"{pdir}/records.bin"), b"partial")
    base = {
        f"ck-0/{participant_key('agent', 'i0')}/{a0.records_file}",
        f"ck-0/{participant_key('agent', 'i0')}/manifest.json",
    }
    plan = collect(open_location(root), 1, now=time.time(), grace_s=GRACE)
    assert "ck-0" in plan.deleted_checkpoints
    assert not base & set(plan.delete)
    assert base <= left(root)
    if root.startswith("s3://"):
        return  # below, ck-0 must be older than ck-1: S3 lists whole seconds
    # Once nothing is in flight, the base goes (what is left of ck-0 looks
    # like a young incomplete checkpoint until the grace period is over).
    open_location(root).delete([k for k in left(root) if k.startswith("ck-2/")])
    collect(open_location(root), 1, now=time.time() + 2 * GRACE, grace_s=GRACE)
    assert not base & left(root)


# --- which is newest: the Gym manifest's own time ------------------------------


def complete_checkpoint(root: str, name: str) -> None:
    where = join_location(root, name)
    m = part(root, name, "agent", records(0))
    write_gym_manifest(where, checkpoint_id=f"c-{name}", manifests=[m])


def same_second(root: pathlib.Path, names: list[str], when: float) -> None:
    """Every file of these checkpoints listed at one whole second, as S3
    lists two checkpoints published within it."""
    for name in names:
        date(root / name, when)


def test_two_checkpoints_in_one_listed_second_are_ordered_by_their_own_time(
    tmp_path: pathlib.Path,
) -> None:
    root = str(tmp_path)
    for name in ("step-9", "step-10"):  # in this order: step-10 is newer
        complete_checkpoint(root, name)
    same_second(tmp_path, ["step-9", "step-10"], 1_800_000_000.0)
    cat = scan(open_location(root))
    assert [e.name for e in cat.entries] == ["step-9", "step-10"]
    assert cat.complete()[0].entry.name == "step-10"
    assert pick_latest(cat).entry.name == "step-10"  # no LATEST: the newest complete
    plan = collect(open_location(root), 1, now=time.time(), grace_s=GRACE)
    assert plan.deleted_checkpoints == ["step-9"]
    assert {e.name for e in scan(open_location(root)).entries} == {"step-10"}


def test_a_gym_manifest_without_its_time_is_still_read(tmp_path: pathlib.Path) -> None:
    """Written before the field existed: decoded, ordered by the listing."""
    root = str(tmp_path)
    for name, when in (("old-b", 1_800_000_010.0), ("old-a", 1_800_000_020.0)):
        complete_checkpoint(root, name)
        key = tmp_path / name / "gym" / "_manifest.json"
        raw = msgspec.json.decode(key.read_bytes())
        del raw["written_at"]
        key.write_bytes(msgspec.json.encode(raw))
        date(tmp_path / name, when)
    gym = read_gym_manifest(join_location(root, "old-a"))
    assert gym.written_at is None
    cat = scan(open_location(root))
    assert all(e.complete for e in cat.entries)
    assert [e.name for e in cat.entries] == ["old-b", "old-a"]
    assert cat.entries[1].time == 1_800_000_020.0


def test_a_retried_gym_manifest_write_returns_the_one_written(tmp_path: pathlib.Path) -> None:
    root = str(tmp_path)
    where = join_location(root, "ck")
    m = part(root, "ck", "agent", records(0))
    first = write_gym_manifest(where, checkpoint_id="c-ck", manifests=[m], now=100.0)
    again = write_gym_manifest(where, checkpoint_id="c-ck", manifests=[m], now=200.0)
    assert again == first
    assert read_gym_manifest(where).written_at == 100.0
