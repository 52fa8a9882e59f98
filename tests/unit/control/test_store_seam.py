"""The engine over the real file store: restore cross-checks the Gym manifest."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_ckpt import Record
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage import write_gym_manifest, write_participant
from ray_ckpt.storage.seam import FileRecordStore
from tests.unit.fakes import FakeParticipant
from tests.unit.helpers import body

SETTINGS = CheckpointSettings(enabled=True, control_auth_token="t")


def commit_dir(root: Path, cid: str, state: object, *, gym: bool = True) -> str:
    d = str(root / cid)
    m = write_participant(
        d, kind="environment", instance="env0", checkpoint_id=cid, records=[Record("r", state)]
    )
    if gym:
        write_gym_manifest(d, checkpoint_id=cid, manifests=[m])
    return d


def fresh() -> tuple[ParticipantEngine, FakeParticipant]:
    p = FakeParticipant()
    return ParticipantEngine(p, instance="env0", settings=SETTINGS, store=FileRecordStore()), p


async def test_restore_from_real_files_installs_under_next_attempt(tmp_path: Path) -> None:
    d = commit_dir(tmp_path, "c1", {"k": [1.5, float("inf")]})
    c, p = fresh()
    reply = await c.handle(
        "restore", body("c1", checkpoint_dir=d, episode_ids=[{"rollout_id": "r"}])
    )
    assert reply == {"phase": "restored", "source_checkpoint_id": "c1", "restored": ["r-a1"]}
    assert p.restored == {"r-a1": {"k": [1.5, float("inf")]}}


async def test_participant_not_in_gym_manifest_installs_nothing(tmp_path: Path) -> None:
    d = commit_dir(tmp_path, "c1", 1)
    # Another participant's commit lands in the same directory after the Gym manifest.
    write_participant(d, kind="environment", instance="env1", checkpoint_id="c1", records=[])
    p = FakeParticipant()
    c = ParticipantEngine(p, instance="env1", settings=SETTINGS, store=FileRecordStore())
    with pytest.raises(InvalidCheckpointState, match="missing from the Gym manifest"):
        await c.handle("restore", body("c1", checkpoint_dir=d, episode_ids=[]))
    assert p.restored == {} and c.status()["phase"] == "idle" and p.admission_open


async def test_swapped_participant_manifest_is_refused(tmp_path: Path) -> None:
    d1 = commit_dir(tmp_path, "c1", "one")
    d2 = commit_dir(tmp_path, "c2", "two", gym=False)
    # Replace c1's participant directory with c2's: the Gym manifest digest no longer matches.
    src = Path(d2) / "gym" / "environment" / "env0"
    dst = Path(d1) / "gym" / "environment" / "env0"
    for f in dst.iterdir():
        f.unlink()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    c, p = fresh()
    with pytest.raises(InvalidCheckpointState, match="digest"):
        await c.handle("restore", body("c1", checkpoint_dir=d1, episode_ids=[{"rollout_id": "r"}]))
    assert p.restored == {} and p.admission_open


async def test_without_gym_manifest_the_participant_manifest_alone_is_checked(
    tmp_path: Path,
) -> None:
    d = commit_dir(tmp_path, "c1", "s", gym=False)
    c, p = fresh()
    reply = await c.handle(
        "restore", body("c1", checkpoint_dir=d, episode_ids=[{"rollout_id": "r"}])
    )
    assert reply["restored"] == ["r-a1"]
    records = Path(d) / "gym" / "environment" / "env0"
    victim = next(f for f in records.iterdir() if f.name.startswith("records-"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    c2, p2 = fresh()
    with pytest.raises(InvalidCheckpointState, match="digest"):
        await c2.handle("restore", body("c1", checkpoint_dir=d, episode_ids=[{"rollout_id": "r"}]))
    assert p2.restored == {}
