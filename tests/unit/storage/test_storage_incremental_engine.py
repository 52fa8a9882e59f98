"""A engine restoring an incremental checkpoint: all of it, or nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_ckpt import Record
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage import open_location, write_gym_manifest
from ray_ckpt.storage.participant.participant_manifest import ParticipantManifest, participant_key
from ray_ckpt.storage.seam import FileRecordStore
from tests.unit.fakes import FakeParticipant
from tests.unit.helpers import body

SETTINGS = CheckpointSettings(enabled=True, control_auth_token="t")
KIND, INST = "environment", "env0"
ROLLOUTS = [f"r{i}" for i in range(10)]


def commit(store: FileRecordStore, root: Path, cid: str, changed: int) -> ParticipantManifest:
    """Every rollout's state; the first `changed` carry this checkpoint's ID."""
    d = str(root / cid)
    records = [
        Record(r, {"at": cid if i < changed else "c0", "pad": "x" * 2000})
        for i, r in enumerate(ROLLOUTS)
    ]
    m: ParticipantManifest = store.write(
        d, kind=KIND, instance=INST, checkpoint_id=cid, records=records, stop=store.new_stop()
    )
    write_gym_manifest(d, checkpoint_id=cid, manifests=[m])
    return m


async def restore(root: Path, cid: str) -> FakeParticipant:
    p = FakeParticipant()
    c = ParticipantEngine(p, instance=INST, settings=SETTINGS, store=FileRecordStore())
    episodes = [{"rollout_id": r} for r in ROLLOUTS]
    await c.handle("restore", body(cid, checkpoint_dir=str(root / cid), episode_ids=episodes))
    return p


async def test_an_incremental_checkpoint_restores_every_record(tmp_path: Path) -> None:
    store = FileRecordStore()
    commit(store, tmp_path, "c0", 10)
    m = commit(store, tmp_path, "c1", 2)
    assert len(m.refs) == 8
    p = await restore(tmp_path, "c1")
    assert {k: v["at"] for k, v in p.restored.items()} == {
        f"{r}-a1": ("c1" if i < 2 else "c0") for i, r in enumerate(ROLLOUTS)
    }


async def test_a_missing_referenced_file_installs_nothing(tmp_path: Path) -> None:
    store = FileRecordStore()
    first = commit(store, tmp_path, "c0", 10)
    commit(store, tmp_path, "c1", 2)
    open_location(str(tmp_path)).delete([f"c0/{participant_key(KIND, INST)}/{first.records_file}"])
    with pytest.raises(InvalidCheckpointState, match=r"referenced records file .* is missing"):
        await restore(tmp_path, "c1")
    p = FakeParticipant()
    c = ParticipantEngine(p, instance=INST, settings=SETTINGS, store=FileRecordStore())
    with pytest.raises(InvalidCheckpointState):
        await c.handle(
            "restore",
            body("c1", checkpoint_dir=str(tmp_path / "c1"), episode_ids=[{"rollout_id": "r9"}]),
        )
    assert p.restored == {}
    assert p.admission_open
    assert c.status()["phase"] == "idle"


def test_a_commit_with_nothing_to_write_reads_no_earlier_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle participant's commit (no episodes) is full by nature: it does
    not read the last checkpoint's manifests to plan references."""
    store = FileRecordStore()
    commit(store, tmp_path, "c0", changed=10)

    def refuse(*_a: object) -> None:
        raise AssertionError("an empty commit looked up its previous checkpoint")

    monkeypatch.setattr(store, "_previous", refuse)
    d = str(tmp_path / "c1")
    m = store.write(
        d, kind=KIND, instance=INST, checkpoint_id="c1", records=[], stop=store.new_stop()
    )
    assert (m.record_count, m.refs, m.chain_depth) == (0, [], 0)
    # With records, it still plans against the previous one.
    with pytest.raises(AssertionError, match="previous checkpoint"):
        commit(store, tmp_path, "c2", changed=1)
