"""Real checkpoints under a real root, for the catalog, retention and CLI tests.

Written with the storage functions every participant and the coordinator use
(no hand-made manifests), then dated with `os.utime` so their order is chosen
by the test, not by how fast the machine writes.
"""

from __future__ import annotations

import os
import pathlib

from ray_ckpt.storage import write_gym_manifest, write_participant
from ray_ckpt.storage.blobstore.locations import open_location
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.root.pointer import write_latest

PARTS = (("agent", "a0"), ("environment", "e0"))


def date(path: pathlib.Path, when: float) -> None:
    """Every file under `path` last written at `when`."""
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            os.utime(pathlib.Path(dirpath, name), (when, when))


def commit(
    root: pathlib.Path,
    name: str,
    when: float,
    *,
    episodes: int = 3,
    gym_manifest: bool = True,
    latest: bool = False,
) -> pathlib.Path:
    """A checkpoint `name` under `root`, written at `when`; complete unless
    `gym_manifest=False` (participants committed, the Gym manifest never
    written: what a crash before the commit point leaves)."""
    d = root / name
    cid = f"ckpt-{name}"
    manifests = [
        write_participant(
            d,
            kind=kind,
            instance=instance,
            checkpoint_id=cid,
            records=[Record(f"r{n}", {"n": n, "x": "y" * 50}) for n in range(episodes)],
        )
        for kind, instance in PARTS
    ]
    if gym_manifest:
        write_gym_manifest(d, checkpoint_id=cid, manifests=manifests, now=when)
    date(d, when)
    if latest:
        write_latest(open_location(str(root)), name, cid)
    return d


def files(root: pathlib.Path) -> set[str]:
    return {
        pathlib.Path(dirpath, n).relative_to(root).as_posix()
        for dirpath, _dirs, names in os.walk(root)
        for n in names
    }
