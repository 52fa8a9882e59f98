"""The catalog of a root: rows, completeness, LATEST and the `latest` pick."""

from __future__ import annotations

import pathlib

import msgspec
import pytest

from ray_ckpt.errors import InvalidCheckpointState, InvalidRequest
from ray_ckpt.storage.blobstore.locations import join_location, open_location, split_location
from ray_ckpt.storage.root import catalog
from ray_ckpt.storage.root.catalog import latest_location, needed_keys, pick_latest, scan, scan_one
from ray_ckpt.storage.root.pointer import (
    LATEST_KEY,
    LatestPointer,
    read_latest,
    write_latest,
    write_latest_for,
)
from tests.unit.storage.catalog_fixtures import PARTS, commit, date

T0 = 1_700_000_000.0


def test_rows_say_what_each_checkpoint_holds(tmp_path: pathlib.Path) -> None:
    commit(tmp_path, "step-1", T0, episodes=3)
    commit(tmp_path, "step-2", T0 + 10, episodes=5, gym_manifest=False)
    # The trainer's own files beside the Gym part are neither listed nor counted.
    (tmp_path / "step-1" / "policy.pt").write_bytes(b"w" * 1000)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    rows = {e.name: e for e in scan(open_location(str(tmp_path))).entries}
    assert set(rows) == {"step-1", "step-2"}
    one, two = rows["step-1"], rows["step-2"]
    assert (one.checkpoint_id, one.complete, one.participants, one.episodes) == (
        "ckpt-step-1",
        True,
        len(PARTS),
        3,
    )
    assert one.time == T0
    gym = (tmp_path / "step-1" / "gym").rglob("*")
    gym_bytes = sum(p.stat().st_size for p in gym if p.is_file())
    assert one.stored_bytes == gym_bytes
    # Its size as inspect, checkpoint and status say it: the records listed.
    gym_manifest = msgspec.json.decode(
        (tmp_path / "step-1" / "gym" / "_manifest.json").read_bytes()
    )
    assert one.bytes == sum(p["bytes"] for p in gym_manifest["participants"]) < gym_bytes
    # Participants committed, no Gym manifest: listed, incomplete.
    assert (two.checkpoint_id, two.complete, two.participants, two.episodes) == (
        "ckpt-step-2",
        False,
        len(PARTS),
        5,
    )
    assert one.referenced_by == two.referenced_by == []


def test_a_tampered_or_truncated_checkpoint_is_not_complete(tmp_path: pathlib.Path) -> None:
    commit(tmp_path, "a", T0)
    commit(tmp_path, "b", T0 + 1)
    commit(tmp_path, "c", T0 + 2)
    manifest = tmp_path / "a" / "gym" / "agent" / "a0" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"record_count"', b' "record_count"'))
    records = next((tmp_path / "b" / "gym" / "environment" / "e0").glob("records-*"))
    records.write_bytes(records.read_bytes()[:-1])
    (tmp_path / "c" / "gym" / "_manifest.json").write_bytes(b"{not json")
    found = scan(open_location(str(tmp_path)))
    assert {e.name: e.complete for e in found.entries} == {"a": False, "b": False, "c": False}
    assert found.checkpoints["a"].problem is not None
    assert "digest" in (found.checkpoints["a"].problem or "")
    with pytest.raises(InvalidCheckpointState, match="no complete checkpoint"):
        pick_latest(found)


def test_latest_is_the_pointer_when_it_names_a_complete_one(tmp_path: pathlib.Path) -> None:
    blobs = open_location(str(tmp_path))
    commit(tmp_path, "old", T0)
    commit(tmp_path, "new", T0 + 10)
    assert pick_latest(scan(blobs)).entry.name == "new"  # no pointer: newest by time
    write_latest(blobs, "old", "ckpt-old")
    assert read_latest(blobs) == LatestPointer("old", "ckpt-old")
    assert pick_latest(scan(blobs)).entry.name == "old"
    # A pointer at an incomplete one, at a name reused by another checkpoint,
    # or at nothing readable falls back to the newest complete by time.
    commit(tmp_path, "newest", T0 + 20, gym_manifest=False)
    for pointer in (("newest", "ckpt-newest"), ("old", "ckpt-other")):
        write_latest(blobs, *pointer)
        assert pick_latest(scan(blobs)).entry.name == "new"
    (tmp_path / LATEST_KEY).write_bytes(b"garbage")
    assert read_latest(blobs) is None
    assert pick_latest(scan(blobs)).entry.name == "new"
    where, picked = latest_location(str(tmp_path), blobs)
    assert where == f"{tmp_path}/new"
    assert picked.episode_keys == ["r0", "r1", "r2"]


def test_no_complete_checkpoint_is_a_typed_error(tmp_path: pathlib.Path) -> None:
    blobs = open_location(str(tmp_path))
    with pytest.raises(InvalidCheckpointState, match="no complete checkpoint"):
        pick_latest(scan(blobs))
    commit(tmp_path, "half", T0, gym_manifest=False)
    with pytest.raises(InvalidCheckpointState, match="no complete checkpoint"):
        latest_location(str(tmp_path), blobs)
    with pytest.raises(InvalidCheckpointState, match="no checkpoint 'gone'"):
        scan_one(blobs, "gone")


def test_write_latest_for_names_the_checkpoint_in_its_parent(tmp_path: pathlib.Path) -> None:
    commit(tmp_path, "step-7", T0)
    write_latest_for(f"{tmp_path}/step-7/", "ckpt-step-7")
    assert read_latest(open_location(str(tmp_path))) == LatestPointer("step-7", "ckpt-step-7")
    assert not list(tmp_path.glob(".LATEST.*")), "no temp object is left behind"


@pytest.mark.parametrize(
    ("location", "parent", "name"),
    [
        ("/ckpt/step-1", "/ckpt", "step-1"),
        ("/ckpt/step-1/", "/ckpt", "step-1"),
        ("/step-1", "/", "step-1"),
        ("file:///a/b", "file:///a", "b"),
        ("file:///b", "file:///", "b"),
        ("s3://bucket/runs/step-1", "s3://bucket/runs", "step-1"),
        ("gs://bucket/step-1", "gs://bucket", "step-1"),
    ],
)
def test_split_location(location: str, parent: str, name: str) -> None:
    assert split_location(location) == (parent, name)
    assert join_location(parent, name) == location.rstrip("/")


@pytest.mark.parametrize("location", ["/", "s3://bucket", "s3://bucket/", "name"])
def test_a_location_without_a_parent_is_refused(location: str) -> None:
    with pytest.raises(InvalidRequest, match="no parent"):
        split_location(location)


def test_needed_keys_are_the_manifests_and_the_records_they_name(tmp_path: pathlib.Path) -> None:
    commit(tmp_path, "s", T0)
    (tmp_path / "s" / "gym" / "agent" / "a0" / "stray.bin").write_bytes(b"x")
    s = scan(open_location(str(tmp_path))).checkpoints["s"]
    names = {k.rpartition("/")[2].split("-")[0] for k in s.needs}
    assert names == {"_manifest.json", "manifest.json", "records"}
    assert len(s.needs) == 1 + 2 * len(PARTS)
    assert all(k.startswith("s/gym/") for k in s.needs)
    assert "s/gym/agent/a0/stray.bin" not in s.needs


def test_referenced_by_comes_from_needed_keys(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one extension point: a checkpoint that needs another's records
    (as an incremental one will) shows up in that one's "referenced by"."""
    commit(tmp_path, "base", T0)
    commit(tmp_path, "delta", T0 + 1)
    base_records = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("base/gym/*/*/r*"))
    real = needed_keys

    def with_reference(name: str, gym: object, manifests: object) -> frozenset[str]:
        keys = real(name, gym, manifests)  # type: ignore[arg-type]
        return keys | {base_records[0]} if name == "delta" else keys

    monkeypatch.setattr(catalog, "needed_keys", with_reference)
    rows = {e.name: e for e in scan(open_location(str(tmp_path))).entries}
    assert rows["base"].referenced_by == ["delta"]
    assert rows["delta"].referenced_by == []
    date(tmp_path / "base", T0)  # scanning changed nothing on disk


def test_a_checkpoint_whose_referenced_records_are_gone_is_not_complete(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An incremental checkpoint needs its base's records: once they are
    deleted (by hand, by another tool) it is listed incomplete and `latest`
    falls back to the newest one that can still restore whole."""
    commit(tmp_path, "old", T0)
    commit(tmp_path, "base", T0 + 1)
    commit(tmp_path, "delta", T0 + 2)
    base_records = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("base/gym/*/*/r*"))
    real = needed_keys

    def with_reference(name: str, gym: object, manifests: object) -> frozenset[str]:
        keys = real(name, gym, manifests)  # type: ignore[arg-type]
        return keys | {base_records[0]} if name == "delta" else keys

    monkeypatch.setattr(catalog, "needed_keys", with_reference)
    location = open_location(str(tmp_path))
    assert pick_latest(scan(location)).entry.name == "delta"
    for records in base_records:
        (tmp_path / records).unlink()
    rows = {e.name: e for e in scan(location).entries}
    assert not rows["delta"].complete
    assert not rows["base"].complete
    assert rows["old"].complete
    assert pick_latest(scan(location)).entry.name == "old"
