"""The Gym manifest over participant manifests in NeMo Gym's shape (real files).

NeMo Gym's participants write `gym/<kind>/<instance>/records-<sha>.jsonl`
(one JSON record a line) and, last, `manifest.json` =
`{schema_version, kind, instance, checkpoint_id, records_file,
records_sha256, record_count, **extras}` (sorted keys, indent 1): none of
our own fields (`digest`, `bytes`, `episodes`, `format`).
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any

import pytest

from coordination.cli.inspect import inspect_checkpoint
from coordination.engine.manifests import write_gym_manifest_from_replies
from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage import read_gym_manifest, verify_checkpoint, write_participant
from ray_ckpt.storage.records.record import Record


def nemo_commit(
    root: pathlib.Path,
    kind: str,
    instance: str,
    cid: str,
    records: list[dict[str, Any]],
    **extra: Any,
) -> dict[str, Any]:
    """A participant manifest written the way NeMo Gym's store writes one."""
    where = root / "gym" / kind / instance
    where.mkdir(parents=True, exist_ok=True)
    data = b"".join((json.dumps(r) + "\n").encode() for r in records)
    sha = hashlib.sha256(data).hexdigest()
    (where / f"records-{sha}.jsonl").write_bytes(data)
    manifest = {
        "schema_version": 1,
        "kind": kind,
        "instance": instance,
        "checkpoint_id": cid,
        "records_file": f"records-{sha}.jsonl",
        "records_sha256": sha,
        "record_count": len(records),
        **extra,
    }
    (where / "manifest.json").write_text(json.dumps(manifest, sort_keys=True, indent=1))
    return manifest


RECORDS = [{"episode_id": {"rollout_id": "r0", "attempt": 0}, "state": {"n": 1}}]


def test_nemo_shaped_manifests_are_listed_by_the_digest_of_their_bytes(
    tmp_path: pathlib.Path,
) -> None:
    model = nemo_commit(tmp_path, "model", "policy", "c1", RECORDS, staging_keys=["k"])
    env = nemo_commit(tmp_path, "environment", "env", "c1", RECORDS * 2)
    gym = write_gym_manifest_from_replies(str(tmp_path), "c1", [model, env])
    assert gym == read_gym_manifest(tmp_path)
    by = {(e.kind, e.instance): e for e in gym.participants}
    for (kind, instance), m in (("model", "policy"), model), (("environment", "env"), env):
        e = by[kind, instance]
        manifest = tmp_path / "gym" / kind / instance / "manifest.json"
        assert e.manifest_digest == hashlib.sha256(manifest.read_bytes()).hexdigest()
        assert e.records_digest == m["records_sha256"]
        assert e.record_count == m["record_count"]
        # No `bytes` in NeMo Gym's manifest: the records file's size.
        assert e.bytes == (manifest.parent / m["records_file"]).stat().st_size
    report = verify_checkpoint(tmp_path)
    assert report.ok, report
    inspected = inspect_checkpoint(tmp_path)
    assert inspected.ok
    assert {(r.kind, r.episodes) for r in inspected.rows} == {("model", 1), ("environment", 2)}


def test_ours_and_nemo_gyms_mix_in_one_checkpoint(tmp_path: pathlib.Path) -> None:
    import msgspec

    ours = write_participant(
        tmp_path, kind="agent", instance="a0", checkpoint_id="c1", records=[Record("r0", {"x": 1})]
    )
    theirs = nemo_commit(tmp_path, "resources", "res", "c1", RECORDS)
    write_gym_manifest_from_replies(str(tmp_path), "c1", [msgspec.to_builtins(ours), theirs])
    report = verify_checkpoint(tmp_path)
    assert report.ok, report
    assert {c.bytes for c in report.participants if c.kind == "agent"} == {ours.bytes}


def test_a_corrupt_nemo_records_file_fails_verification(tmp_path: pathlib.Path) -> None:
    m = nemo_commit(tmp_path, "model", "policy", "c1", RECORDS)
    write_gym_manifest_from_replies(str(tmp_path), "c1", [m])
    records = tmp_path / "gym" / "model" / "policy" / m["records_file"]
    records.write_bytes(records.read_bytes().replace(b'"n": 1', b'"n": 2'))
    [check] = verify_checkpoint(tmp_path).participants
    assert not check.ok
    assert "digest" in (check.error or "")


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"checkpoint_id": "c2"}, "committed checkpoint 'c2'"),
        ({"records_sha256": "zz"}, "differs from the committed one"),
    ],
)
def test_a_nemo_manifest_that_is_not_the_committed_one_is_refused(
    tmp_path: pathlib.Path, change: dict[str, Any], why: str
) -> None:
    m = nemo_commit(tmp_path, "model", "policy", "c1", RECORDS)
    with pytest.raises(InvalidCheckpointState, match=why):
        write_gym_manifest_from_replies(str(tmp_path), "c1", [{**m, **change}])
    assert not (tmp_path / "gym" / "_manifest.json").exists()


def test_a_nemo_manifest_whose_records_are_missing_is_refused(tmp_path: pathlib.Path) -> None:
    m = nemo_commit(tmp_path, "model", "policy", "c1", RECORDS)
    (tmp_path / "gym" / "model" / "policy" / m["records_file"]).unlink()
    with pytest.raises(InvalidCheckpointState, match="missing"):
        write_gym_manifest_from_replies(str(tmp_path), "c1", [m])
