"""A restore that names no episodes continues the checkpoint's episodes only.

A checkpoint taken with completion receipts on also holds the finished,
unacknowledged results (`result:<capture key>` records): they are installed
again by the restore, but they are not episodes to continue.  Found by the
seeded simulation: a drain (whose restore names no episodes) of a Gym with a
held result failed every retry with "malformed capture key 'result:r2'".
"""

from __future__ import annotations

import pathlib

from coordination.engine.roots import list_root, restore_target
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage import write_gym_manifest, write_participant
from ray_ckpt.storage.records.record import Record


def _checkpoint_with_a_held_result(root: pathlib.Path) -> pathlib.Path:
    d = root / "step-1"
    records = [
        Record("r0", {"next": "step"}),
        Record("r1-a1", {"next": "verify"}),
        Record("result:r2", {"reward": 1.0}),
    ]
    manifest = write_participant(
        d, kind="environment", instance="e0", checkpoint_id="ckpt-1", records=records
    )
    write_gym_manifest(d, checkpoint_id="ckpt-1", manifests=[manifest])
    return d


async def test_a_restore_without_episodes_continues_episodes_not_held_results(
    tmp_path: pathlib.Path,
) -> None:
    d = _checkpoint_with_a_held_result(tmp_path)
    where, episodes = await restore_target(str(d), None, latest=False)
    assert where == str(d)
    assert episodes == [EpisodeId("r0", 0), EpisodeId("r1", 1)]
    where, episodes = await restore_target(str(tmp_path), None, latest=True)
    assert (where, episodes) == (str(d), [EpisodeId("r0", 0), EpisodeId("r1", 1)])


def test_the_catalog_counts_episodes_not_held_results(tmp_path: pathlib.Path) -> None:
    _checkpoint_with_a_held_result(tmp_path)
    (entry,) = list_root(str(tmp_path))
    assert entry.episodes == 2
