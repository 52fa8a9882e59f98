"""Retention over real checkpoints on disk: what goes, what never goes."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

import pytest

from ray_ckpt.errors import InvalidRequest
from ray_ckpt.storage.blobstore.blobs import Blobs, temp_key
from ray_ckpt.storage.blobstore.local_blobs import LocalBlobs
from ray_ckpt.storage.blobstore.locations import open_location
from ray_ckpt.storage.root import catalog
from ray_ckpt.storage.root.catalog import needed_keys, scan
from ray_ckpt.storage.root.pointer import write_latest
from ray_ckpt.storage.root.retention import collect, plan_retention
from tests.unit.storage.catalog_fixtures import commit, files

T0 = 1_700_000_000.0
NOW = T0 + 100_000
GRACE = 600.0


class CountingBlobs(LocalBlobs):
    """A real LocalBlobs that records each delete call."""

    def __init__(self, root: pathlib.Path) -> None:
        super().__init__(root)
        self.deletes: list[list[str]] = []

    def delete(self, keys: Sequence[str]) -> None:
        self.deletes.append(list(keys))
        super().delete(keys)


def names(root: pathlib.Path) -> set[str]:
    return {e.name for e in scan(open_location(str(root))).entries}


def complete(root: pathlib.Path) -> set[str]:
    return {e.name for e in scan(open_location(str(root))).entries if e.complete}


def test_keep_k_deletes_the_older_ones_in_one_batched_call(tmp_path: pathlib.Path) -> None:
    for i in range(5):
        commit(tmp_path, f"s{i}", T0 + i)
    blobs = CountingBlobs(tmp_path)
    plan = collect(blobs, 2, now=NOW, grace_s=GRACE)
    assert plan.deleted
    assert plan.deleted_checkpoints == ["s0", "s1", "s2"]
    assert names(tmp_path) == complete(tmp_path) == {"s3", "s4"}
    assert len(blobs.deletes) == 1, "one batched delete, not one per key"
    assert sorted(blobs.deletes[0]) == plan.delete
    assert all(k.split("/")[0] in {"s0", "s1", "s2"} for k in plan.delete)
    # Their empty folders go too (on disk), nothing else.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s3", "s4"]
    assert collect(blobs, 2, now=NOW, grace_s=GRACE).delete == []


def test_an_incomplete_newest_never_costs_the_last_complete_one(tmp_path: pathlib.Path) -> None:
    commit(tmp_path, "good", T0)
    commit(tmp_path, "crashed", T0 + 10, gym_manifest=False)
    commit(tmp_path, "in-flight", T0 + 20, gym_manifest=False)
    before = files(tmp_path)
    plan = collect(open_location(str(tmp_path)), 1, now=NOW, grace_s=GRACE)
    assert plan.delete == []
    assert files(tmp_path) == before
    reasons = {r.name: r.reason for r in plan.rows}
    assert "newer than every complete one" in reasons["in-flight"]
    # Once a newer one is complete, the old complete one and the abandoned
    # incomplete ones go.
    commit(tmp_path, "better", T0 + 30)
    plan = collect(open_location(str(tmp_path)), 1, now=NOW, grace_s=GRACE)
    assert sorted(plan.deleted_checkpoints) == ["crashed", "good", "in-flight"]
    assert names(tmp_path) == {"better"}


def test_a_young_incomplete_one_stays_even_behind_a_complete_one(tmp_path: pathlib.Path) -> None:
    commit(tmp_path, "writing", NOW - 10, gym_manifest=False)
    commit(tmp_path, "done", NOW - 5)
    plan = collect(open_location(str(tmp_path)), 1, now=NOW, grace_s=GRACE)
    assert plan.delete == []
    assert names(tmp_path) == {"writing", "done"}


def test_a_key_a_kept_checkpoint_needs_is_never_deleted(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    commit(tmp_path, "base", T0)
    commit(tmp_path, "delta", T0 + 1)
    shared = sorted(
        p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("base/gym/*/*/records-*")
    )[0]

    def referencing(name: str, gym: object, manifests: object) -> frozenset[str]:
        keys = needed_keys(name, gym, manifests)  # type: ignore[arg-type]
        return keys | {shared} if name == "delta" else keys

    monkeypatch.setattr(catalog, "needed_keys", referencing)
    plan = collect(open_location(str(tmp_path)), 1, now=NOW, grace_s=GRACE)
    assert plan.deleted_checkpoints == ["base"]
    assert shared not in plan.delete
    assert (tmp_path / shared).is_file()
    assert "keys stay" in next(r.reason for r in plan.rows if r.name == "base")
    assert {k for k in files(tmp_path) if k.startswith("base/")} == {shared}
    assert complete(tmp_path) == {"delta"}


def test_the_checkpoint_latest_names_stays(tmp_path: pathlib.Path) -> None:
    for i in range(3):
        commit(tmp_path, f"s{i}", T0 + i)
    write_latest(open_location(str(tmp_path)), "s0", "ckpt-s0")
    plan = collect(open_location(str(tmp_path)), 1, now=NOW, grace_s=GRACE)
    assert plan.deleted_checkpoints == ["s1"]
    assert names(tmp_path) == {"s0", "s2"}


def test_old_temp_files_are_collected_young_ones_and_trainer_files_stay(
    tmp_path: pathlib.Path,
) -> None:
    ckpt = commit(tmp_path, "s", T0)
    pdir = ckpt / "gym" / "agent" / "a0"
    old = [pdir / temp_key("records").rpartition("/")[2], tmp_path / temp_key("LATEST")]
    young = [pdir / temp_key("manifest.json").rpartition("/")[2], tmp_path / temp_key("probe")]
    for p in old + young:
        p.write_bytes(b"partial")
    for p in old:
        os.utime(p, (NOW - GRACE - 1, NOW - GRACE - 1))
    for p in young:
        os.utime(p, (NOW - GRACE + 60, NOW - GRACE + 60))
    trainer = [ckpt / f".weights.{'a' * 32}.tmp", tmp_path / "run" / f".log.{'b' * 32}.tmp"]
    for p in trainer:
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"not ours")
        os.utime(p, (T0, T0))
    before = files(tmp_path)
    plan = collect(open_location(str(tmp_path)), 1, now=NOW, grace_s=GRACE)
    collected = {p.relative_to(tmp_path).as_posix() for p in old}
    assert set(plan.delete) == collected
    assert [r.action for r in plan.rows] == ["keep", "collect"]
    assert files(tmp_path) == before - collected
    assert complete(tmp_path) == {"s"}


def test_dry_run_plans_and_deletes_nothing(tmp_path: pathlib.Path) -> None:
    for i in range(3):
        commit(tmp_path, f"s{i}", T0 + i)
    (tmp_path / temp_key("probe")).write_bytes(b"")
    os.utime(tmp_path / sorted(os.listdir(tmp_path))[0], (T0, T0))
    before = files(tmp_path)
    blobs = CountingBlobs(tmp_path)
    plan = collect(blobs, 1, dry_run=True, now=NOW, grace_s=GRACE)
    assert plan.dry_run
    assert not plan.deleted
    assert plan.deleted_checkpoints == ["s0", "s1"]
    assert plan.delete
    assert plan.bytes > 0
    assert blobs.deletes == []
    assert files(tmp_path) == before
    # The same plan, carried out, deletes exactly what it listed.
    done = collect(blobs, 1, now=NOW, grace_s=GRACE)
    assert done.delete == plan.delete
    assert files(tmp_path) == before - set(plan.delete)


@pytest.mark.parametrize("keep", [0, -1, True])
def test_keep_must_leave_at_least_one(tmp_path: pathlib.Path, keep: int) -> None:
    commit(tmp_path, "s", T0)
    before = files(tmp_path)
    with pytest.raises(InvalidRequest, match="keep must be"):
        collect(open_location(str(tmp_path)), keep, now=NOW, grace_s=GRACE)
    assert files(tmp_path) == before


def test_the_plan_is_pure(tmp_path: pathlib.Path) -> None:
    for i in range(3):
        commit(tmp_path, f"s{i}", T0 + i)
    blobs: Blobs = open_location(str(tmp_path))
    before = files(tmp_path)
    found = scan(blobs)
    first = plan_retention(found, 1, now=NOW, grace_s=GRACE)
    assert plan_retention(found, 1, now=NOW, grace_s=GRACE) == first
    assert files(tmp_path) == before
