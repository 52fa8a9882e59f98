"""The coordinator's storage glue on real directories: LATEST after the Gym
manifest, what a restore of a root or a checkpoint resolves to, and the
up-front checks."""

from __future__ import annotations

import logging
import pathlib

import msgspec
import pytest

from coordination.engine import roots
from ray_ckpt.errors import InvalidCheckpointState, InvalidRequest
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage import read_gym_manifest, write_participant
from ray_ckpt.storage.blobstore.locations import open_location
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.root.catalog import scan
from ray_ckpt.storage.root.pointer import LatestPointer, read_latest
from tests.unit.storage.catalog_fixtures import commit

T0 = 1_700_000_000.0


def committed(d: pathlib.Path, cid: str) -> list[dict[str, object]]:
    """Participant manifests as commit replies carry them (no Gym manifest yet)."""
    m = write_participant(
        d, kind="agent", instance="a0", checkpoint_id=cid, records=[Record("r1", {"n": 1})]
    )
    return [msgspec.to_builtins(m)]


def test_latest_follows_the_gym_manifest(tmp_path: pathlib.Path) -> None:
    d = tmp_path / "step-9"
    manifests = committed(d, "ckpt-9")
    assert read_latest(open_location(str(tmp_path))) is None
    roots.write_gym_manifest_and_latest(str(d), "ckpt-9", manifests)
    assert read_gym_manifest(str(d)).checkpoint_id == "ckpt-9"
    assert read_latest(open_location(str(tmp_path))) == LatestPointer("step-9", "ckpt-9")


def test_a_latest_that_cannot_be_written_does_not_fail_a_complete_checkpoint(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    d = tmp_path / "step-9"
    manifests = committed(d, "ckpt-9")

    def broken(checkpoint_dir: str, checkpoint_id: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(roots, "write_latest_for", broken)
    with caplog.at_level(logging.WARNING, logger="coordination.engine.roots"):
        gym = roots.write_gym_manifest_and_latest(str(d), "ckpt-9", manifests)
    assert gym.checkpoint_id == "ckpt-9"
    assert "LATEST not updated" in caplog.text
    assert [e.complete for e in scan(open_location(str(tmp_path))).entries] == [True]


async def test_a_restore_of_a_root_by_latest_takes_the_newest_and_its_episodes(
    tmp_path: pathlib.Path,
) -> None:
    commit(tmp_path, "old", T0, episodes=5)
    commit(tmp_path, "new", T0 + 1, episodes=2)
    commit(tmp_path, "newer-but-torn", T0 + 2, gym_manifest=False)
    where, eps = await roots.restore_target(str(tmp_path), None, latest=True)
    assert where == f"{tmp_path}/new"
    assert eps == [EpisodeId("r0"), EpisodeId("r1")]
    chosen = [EpisodeId("r1", 2)]
    assert await roots.restore_target(str(tmp_path), chosen, latest=True) == (where, chosen)


async def test_a_plain_restore_without_episodes_takes_the_checkpoints_own(
    tmp_path: pathlib.Path,
) -> None:
    d = commit(tmp_path, "old", T0, episodes=3)
    where, eps = await roots.restore_target(str(d), None, latest=False)
    assert (where, [e.capture_key for e in eps]) == (str(d), ["r0", "r1", "r2"])
    # Named episodes are taken as they are, and nothing is read for them.
    assert await roots.restore_target(str(tmp_path / "absent"), [EpisodeId("x")], latest=False)


async def test_what_a_restore_cannot_use_is_refused_naming_it(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidCheckpointState, match="no complete checkpoint"):
        await roots.restore_target(str(tmp_path), None, latest=True)
    torn = commit(tmp_path, "torn", T0, gym_manifest=False)
    with pytest.raises(InvalidCheckpointState, match=r"not complete.*no Gym manifest"):
        await roots.restore_target(str(torn), None, latest=False)
    (tmp_path / "file").write_text("x")
    for where in ("relative/x", "s4://b/x", f"{tmp_path}/file/x", f"{tmp_path}/none/x"):
        for latest in (True, False):
            with pytest.raises(InvalidRequest) as info:
                await roots.restore_target(where, [EpisodeId("r")], latest=latest)
            assert where in info.value.detail


async def test_writable_refuses_a_path_through_a_file(tmp_path: pathlib.Path) -> None:
    (tmp_path / "file").write_text("x")
    await roots.writable(str(tmp_path / "ok" / "ckpt"))
    assert (tmp_path / "ok" / "ckpt").is_dir()
    assert list((tmp_path / "ok" / "ckpt").iterdir()) == [], "the probe is gone"
    with pytest.raises(InvalidRequest, match="file"):
        await roots.writable(str(tmp_path / "file" / "ckpt"))
