"""The Gym manifest, whole-checkpoint verification and `inspect`."""

from __future__ import annotations

import json
import pathlib

import msgspec
import pytest

from coordination.cli.inspect import InspectReport, inspect_checkpoint, render_inspect
from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage import (
    ParticipantManifest,
    participant_dir,
    read_gym_manifest,
    verify_checkpoint,
    write_gym_manifest,
    write_participant,
)
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.root.gym_manifest import gym_manifest_path

PARTS = [("agent", "a0"), ("environment", "e0"), ("environment", "e1")]


def commit(d: pathlib.Path, cid: str = "c1") -> list[ParticipantManifest]:
    ms = [
        write_participant(
            d,
            kind=k,
            instance=i,
            checkpoint_id=cid,
            records=[Record(f"{i}-r{n}", {"n": n, "x": "y" * 100}) for n in range(3)],
        )
        for k, i in PARTS
    ]
    write_gym_manifest(d, checkpoint_id=cid, manifests=ms)
    return ms


def test_gym_manifest_lists_every_participant_with_its_digests(tmp_path: pathlib.Path) -> None:
    ms = commit(tmp_path)
    gym = read_gym_manifest(tmp_path)
    assert gym.checkpoint_id == "c1"
    assert [(e.kind, e.instance) for e in gym.participants] == PARTS
    for e, m in zip(gym.participants, ms, strict=True):
        assert e.records_digest == m.digest
        assert e.record_count == 3
        assert e.bytes == m.bytes
    assert gym.entry("environment", "e1").kind == "environment"
    with pytest.raises(InvalidCheckpointState, match="missing from the Gym manifest"):
        gym.entry("resources", "r0")


def test_gym_manifest_is_created_never_replaced(tmp_path: pathlib.Path) -> None:
    ms = commit(tmp_path)
    before = gym_manifest_path(tmp_path).read_bytes()
    assert write_gym_manifest(tmp_path, checkpoint_id="c1", manifests=ms) == read_gym_manifest(
        tmp_path
    )
    with pytest.raises(InvalidCheckpointState, match="never replaced"):
        write_gym_manifest(tmp_path, checkpoint_id="c1", manifests=ms[:2])
    assert gym_manifest_path(tmp_path).read_bytes() == before


def test_gym_manifest_refuses_inconsistent_participants(tmp_path: pathlib.Path) -> None:
    ms = commit(tmp_path / "a")
    with pytest.raises(InvalidCheckpointState, match="not 'c2'"):
        write_gym_manifest(tmp_path / "a", checkpoint_id="c2", manifests=ms)
    with pytest.raises(InvalidCheckpointState, match="listed twice"):
        write_gym_manifest(tmp_path / "a", checkpoint_id="c1", manifests=[ms[0], ms[0]])
    with pytest.raises(InvalidCheckpointState, match="missing manifest"):
        write_gym_manifest(tmp_path / "b", checkpoint_id="c1", manifests=ms)
    assert not gym_manifest_path(tmp_path / "b").exists()


def test_missing_or_corrupt_gym_manifest(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidCheckpointState, match="missing Gym manifest"):
        read_gym_manifest(tmp_path)
    commit(tmp_path)
    gym_manifest_path(tmp_path).write_bytes(b"{")
    with pytest.raises(InvalidCheckpointState, match="corrupt Gym manifest"):
        read_gym_manifest(tmp_path)
    raw = {"schema_version": 7, "checkpoint_id": "c1", "participants": []}
    gym_manifest_path(tmp_path).write_bytes(json.dumps(raw).encode())
    with pytest.raises(InvalidCheckpointState, match="schema version 7"):
        read_gym_manifest(tmp_path)


def test_a_listed_participant_with_an_escaping_name_is_refused(tmp_path: pathlib.Path) -> None:
    raw = {
        "schema_version": 1,
        "checkpoint_id": "c1",
        "participants": [
            {
                "kind": "..",
                "instance": "x",
                "manifest_digest": "",
                "records_digest": "",
                "record_count": 0,
                "bytes": 0,
            }
        ],
    }
    gym_manifest_path(tmp_path).parent.mkdir(parents=True)
    gym_manifest_path(tmp_path).write_bytes(json.dumps(raw).encode())
    with pytest.raises(InvalidCheckpointState, match="bad kind name"):
        read_gym_manifest(tmp_path)


def test_verify_passes_a_complete_checkpoint(tmp_path: pathlib.Path) -> None:
    commit(tmp_path)
    report = verify_checkpoint(tmp_path)
    assert report.ok
    assert report.errors == []
    assert [c.ok for c in report.participants] == [True, True, True]


def test_verify_reports_missing_torn_and_unlisted_participants(tmp_path: pathlib.Path) -> None:
    commit(tmp_path)
    # A listed participant whose manifest is gone, one whose records are torn ...
    (participant_dir(tmp_path, "agent", "a0") / "manifest.json").unlink()
    e0 = participant_dir(tmp_path, "environment", "e0")
    rec = next(e0.glob("records-*"))
    rec.write_bytes(rec.read_bytes()[:-4])
    # ... and a committed participant that the Gym manifest does not list.
    write_participant(tmp_path, kind="resources", instance="r0", checkpoint_id="c1", records=[])
    report = verify_checkpoint(tmp_path)
    assert not report.ok
    by = {(c.kind, c.instance): c for c in report.participants}
    assert "missing manifest" in (by["agent", "a0"].error or "")
    assert "truncated" in (by["environment", "e0"].error or "")
    assert by["environment", "e1"].ok
    assert not by["resources", "r0"].listed
    assert "not listed" in (by["resources", "r0"].error or "")


def test_verify_a_changed_participant_manifest(tmp_path: pathlib.Path) -> None:
    commit(tmp_path)
    path = participant_dir(tmp_path, "environment", "e1") / "manifest.json"
    path.write_bytes(path.read_bytes() + b" ")
    report = verify_checkpoint(tmp_path)
    bad = [c for c in report.participants if not c.ok]
    assert [(c.instance, "digest" in (c.error or "")) for c in bad] == [("e1", True)]


def test_inspect_renders_a_table_and_json(tmp_path: pathlib.Path) -> None:
    commit(tmp_path)
    report = inspect_checkpoint(tmp_path)
    assert report.ok
    assert len(report.rows) == 3
    text = render_inspect(report)
    assert "checkpoint c1" in text
    assert ": OK" in text
    for kind, inst in PARTS:
        assert kind in text
        assert inst in text
    assert "3 participants, 9 episodes" in text
    back = msgspec.json.decode(msgspec.json.encode(report), type=InspectReport)
    assert back == report


def test_inspect_of_an_incomplete_checkpoint(tmp_path: pathlib.Path) -> None:
    write_participant(tmp_path, kind="agent", instance="a0", checkpoint_id="c1", records=[])
    report = inspect_checkpoint(tmp_path)
    assert not report.ok
    assert report.checkpoint_id is None
    assert any("missing Gym manifest" in e for e in report.errors)
    assert [r.listed for r in report.rows] == [False]
    assert report.state == "incomplete"  # never published, not corrupt
    text = render_inspect(report)
    for part in ("INCOMPLETE", "missing Gym manifest", "not listed"):
        assert part in text
