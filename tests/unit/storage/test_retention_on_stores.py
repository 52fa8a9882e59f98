"""Listing, LATEST, latest and retention on local disk and on S3 (moto over
HTTP on 127.0.0.1): the same code through `Blobs`, the same answers."""

from __future__ import annotations

import asyncio

import msgspec

from coordination.engine import roots
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage import open_location, write_participant
from ray_ckpt.storage.blobstore.locations import join_location
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.root.catalog import latest_location, scan
from ray_ckpt.storage.root.pointer import read_latest
from ray_ckpt.storage.root.retention import collect
from tests.s3_server import local_or_s3_root, s3_endpoint

__all__ = ["local_or_s3_root", "s3_endpoint"]  # the fixtures, imported for pytest


def checkpoint(root: str, name: str, *, episodes: int = 2, complete: bool = True) -> None:
    where = join_location(root, name)
    cid = f"ckpt-{name}"
    manifests = [
        write_participant(
            where,
            kind=kind,
            instance="i0",
            checkpoint_id=cid,
            records=[Record(f"r{n}", {"n": n}) for n in range(episodes)],
        )
        for kind in ("agent", "environment")
    ]
    if complete:
        roots.write_gym_manifest_and_latest(where, cid, [_reply(m) for m in manifests])


def _reply(m: object) -> dict[str, object]:
    """A participant manifest as its commit reply carries it."""
    out = msgspec.to_builtins(m)
    assert isinstance(out, dict)
    return out


async def test_list_latest_and_keep_on_any_store(root: str) -> None:
    for i in range(3):
        checkpoint(root, f"s{i}", episodes=i + 1)
        await asyncio.sleep(0.01)  # distinct write times where the store keeps sub-seconds
    checkpoint(root, "s3-torn", complete=False)
    blobs = open_location(root)
    rows = {e.name: e for e in scan(blobs).entries}
    assert {n: e.complete for n, e in rows.items()} == {
        "s0": True,
        "s1": True,
        "s2": True,
        "s3-torn": False,
    }
    assert rows["s2"].episodes == 3
    assert rows["s2"].participants == 2
    assert rows["s2"].bytes > 0
    pointer = read_latest(blobs)
    assert pointer is not None
    assert pointer.name == "s2"
    where, picked = latest_location(root, blobs)
    assert where == join_location(root, "s2")
    assert picked.episode_keys == ["r0", "r1", "r2"]
    target = await roots.restore_target(root, None, latest=True)
    assert target == (where, [EpisodeId("r0"), EpisodeId("r1"), EpisodeId("r2")])

    dry = collect(blobs, 1, dry_run=True)
    assert sorted(dry.deleted_checkpoints) == ["s0", "s1"]
    assert {e.name for e in scan(blobs).entries} == set(rows), "a dry run deletes nothing"
    done = collect(blobs, 1)
    assert done.delete == dry.delete
    left = {e.name: e.complete for e in scan(blobs).entries}
    # The torn one is newer than every complete one: it may be in flight, it stays.
    assert left == {"s2": True, "s3-torn": False}
    assert not [i.key for i in blobs.list() if i.key.startswith(("s0/", "s1/"))]
    assert roots.list_root(root) == scan(blobs).entries
