"""Two participants misconfigured with the same kind and instance, one directory.

Each writes its records file and races for the one manifest.  Whatever the
interleaving, the manifest that won names a records file that exists and
verifies: the loser never unlinks a file the winner's manifest names, nor a
temp file the other is still writing.  Real threads, real files; the record
streams meet at a barrier so both writers publish at the same moment.
"""

from __future__ import annotations

import os
import pathlib
import threading
from collections.abc import Iterator

import pytest

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage import load_manifest, read_participant, write_participant
from ray_ckpt.storage.blobstore.durable import create_never_replace
from ray_ckpt.storage.records.record import Record

ROUNDS = 60


def _records(barrier: threading.Barrier, state: object) -> Iterator[Record]:
    yield Record("r1", state)
    # Both writers finished encoding: they publish together.
    barrier.wait(timeout=10)


def _race(pdir_root: pathlib.Path, states: tuple[object, object], ids: tuple[str, str]) -> None:
    barrier = threading.Barrier(2)
    outcomes: list[object] = []

    def write(state: object, cid: str) -> None:
        try:
            outcomes.append(
                write_participant(
                    pdir_root,
                    kind="environment",
                    instance="env-0",
                    checkpoint_id=cid,
                    records=_records(barrier, state),
                )
            )
        except InvalidCheckpointState as exc:
            outcomes.append(exc)

    threads = [
        threading.Thread(target=write, args=(s, c)) for s, c in zip(states, ids, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(outcomes) == 2
    won = load_manifest(pdir_root, kind="environment", instance="env-0", checkpoint_id=None)
    # The winner's records are all there and verify.
    _, records = read_participant(
        pdir_root, kind="environment", instance="env-0", checkpoint_id=won.checkpoint_id
    )
    assert [r.key for r in records] == ["r1"]
    pdir = pdir_root / "gym" / "environment" / "env-0"
    # Nothing but the manifest and the file it names stays behind.
    assert sorted(os.listdir(pdir)) == sorted(["manifest.json", won.records_file])


@pytest.mark.parametrize(
    ("states", "ids"),
    [
        (({"same": 1}, {"same": 1}), ("c1", "c2")),  # same bytes, two checkpoint ids
        (({"a": 1}, {"b": 2}), ("c1", "c1")),  # one id, different records
        (({"a": 1}, {"b": 2}), ("c1", "c2")),
    ],
    ids=["same_records", "same_id", "both_differ"],
)
def test_twins_never_unlink_each_others_records(
    tmp_path: pathlib.Path, states: tuple[object, object], ids: tuple[str, str]
) -> None:
    for i in range(ROUNDS):
        _race(tmp_path / str(i), states, ids)


def test_create_never_replace_temp_names_are_unique_per_call(tmp_path: pathlib.Path) -> None:
    # Two hosts sharing a file system can have the same pid and thread id: a
    # temp name built from those alone lets one writer unlink the other's temp.
    final = tmp_path / "manifest.json"
    squatter = tmp_path / f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    squatter.write_bytes(b"another writer's temp")
    assert create_never_replace(final, b"mine") is None
    assert final.read_bytes() == b"mine"
    assert squatter.read_bytes() == b"another writer's temp"
