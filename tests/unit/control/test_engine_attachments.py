"""Attachments through the participant engine, over the real file store.

The asynchronous commit's capture keeps each record's attachments (a copy
of the map, so the live one may change during the write); a restore hands
the install verified local files, and the folder it downloaded them into
is gone once the install ends, whether it succeeded, failed, or the read
itself failed.
"""

from __future__ import annotations

import asyncio
import pathlib
import tempfile
from collections.abc import Sequence
from typing import Any

import blake3
import msgspec
import pytest

from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.identity import EpisodeId
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage import open_location, read_participant, write_gym_manifest, write_participant
from ray_ckpt.storage.blobstore.locations import join_location
from ray_ckpt.storage.participant.participant_manifest import participant_key
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.seam import FileRecordStore
from ray_ckpt.workers import frames
from tests.s3_server import local_or_s3_root, s3_endpoint
from tests.unit.fakes import FakeParticipant
from tests.unit.helpers import body

__all__ = ["local_or_s3_root", "s3_endpoint"]  # the fixtures, imported for pytest

SETTINGS = CheckpointSettings(enabled=True, control_auth_token="t")
INST = "env0"


class Attached(FakeParticipant):
    """Exports each episode with the files `attach` names; its install reads
    them (and keeps only their bytes, as a real one copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.attach: dict[str, dict[str, str]] = {}
        self.seen: dict[str, dict[str, bytes]] = {}
        self.fail_install = False

    async def export(self, scope: Sequence[EpisodeId] | None) -> list[Record]:
        return [
            msgspec.structs.replace(r, attachments=self.attach.get(r.key))
            for r in await super().export(scope)
        ]

    async def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        for r in records:
            self.seen[r.key] = await asyncio.to_thread(contents, r.attachments or {})
        if self.fail_install:
            raise RuntimeError("install failed")
        return await super().install(records)


def contents(attachments: dict[str, str]) -> dict[str, bytes]:
    return {d: pathlib.Path(p).read_bytes() for d, p in attachments.items()}


def leftovers(folder: pathlib.Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def add(folder: pathlib.Path, data: bytes) -> tuple[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    digest = blake3.blake3(data).hexdigest()
    (folder / digest).write_bytes(data)
    return digest, str(folder / digest)


async def test_the_asynchronous_commit_keeps_a_copy_of_the_attachments(
    tmp_path: pathlib.Path,
) -> None:
    p = Attached()
    c = ParticipantEngine(p, instance=INST, settings=SETTINGS, store=FileRecordStore())
    digest, path = add(tmp_path / "src", b"sandbox file" * 100)
    p.start("r1", at_boundary=True, state={"snapshot": [digest]})
    p.attach["r1"] = {digest: path}
    await c.handle("prepare", body("c1"))
    ck = str(tmp_path / "ck")
    reply = await c.handle("commit", body("c1", checkpoint_dir=ck, durability="async"))
    assert reply["pending"] is True
    p.attach["r1"].clear()  # the live map changes after the capture
    await c.handle("resume", body("c1"))
    final = await c.handle("commit", body("c1", checkpoint_dir=ck, durability="async"))
    assert final["manifest"]["attachments"] == {"r1": [digest]}
    assert final["manifest"]["blob_bytes"] == 1200
    _, records = read_participant(ck, kind=p.kind, instance=INST, checkpoint_id="c1")
    assert contents(records[0].attachments or {}) == {digest: b"sandbox file" * 100}
    await c.aclose()


def checkpoint(root: str, files: pathlib.Path) -> tuple[str, str, bytes]:
    data = b"restored file" * 50
    digest, path = add(files, data)
    where = join_location(root, "c1")
    m = write_participant(
        where,
        kind="environment",
        instance=INST,
        checkpoint_id="c1",
        records=[Record("r", {"snapshot": [digest]}, attachments={digest: path})],
    )
    write_gym_manifest(where, checkpoint_id="c1", manifests=[m])
    return where, digest, data


@pytest.fixture
def temp_root(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """Where this test's temporary folders go, to see that none is left."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


async def test_a_restore_installs_verified_files_and_removes_its_downloads(
    root: str, tmp_path: pathlib.Path, temp_root: pathlib.Path
) -> None:
    where, digest, data = checkpoint(root, tmp_path / "src")
    p = Attached()
    c = ParticipantEngine(p, instance=INST, settings=SETTINGS, store=FileRecordStore())
    reply = await c.handle(
        "restore", body("c1", checkpoint_dir=where, episode_ids=[{"rollout_id": "r"}])
    )
    assert reply["restored"] == ["r-a1"]
    assert p.seen == {"r": {digest: data}}
    assert p.restored == {"r-a1": {"snapshot": [digest]}}
    assert leftovers(temp_root) == []
    await c.aclose()


async def test_a_failed_install_removes_the_downloads_too(
    root: str, tmp_path: pathlib.Path, temp_root: pathlib.Path
) -> None:
    where, digest, data = checkpoint(root, tmp_path / "src")
    p = Attached()
    p.fail_install = True
    c = ParticipantEngine(p, instance=INST, settings=SETTINGS, store=FileRecordStore())
    with pytest.raises(InvalidCheckpointState, match="install failed"):
        await c.handle(
            "restore", body("c1", checkpoint_dir=where, episode_ids=[{"rollout_id": "r"}])
        )
    assert p.seen == {"r": {digest: data}}  # it had the files while it ran
    assert leftovers(temp_root) == []
    await c.aclose()


async def test_a_corrupt_attachment_installs_nothing_and_leaves_no_folder(
    root: str, tmp_path: pathlib.Path, temp_root: pathlib.Path
) -> None:
    where, digest, _ = checkpoint(root, tmp_path / "src")
    blobs = open_location(where)
    key = f"{participant_key('environment', INST)}/blobs/{digest}"
    blobs.replace(key, blobs.read(key)[::-1])
    p = Attached()
    c = ParticipantEngine(p, instance=INST, settings=SETTINGS, store=FileRecordStore())
    with pytest.raises(InvalidCheckpointState, match="corrupt"):
        await c.handle(
            "restore", body("c1", checkpoint_dir=where, episode_ids=[{"rollout_id": "r"}])
        )
    assert p.seen == {}
    assert p.restored == {}
    assert leftovers(temp_root) == []
    # Nothing was installed: the process may still restore (from a good one).
    assert c.status()["phase"] == "idle"
    await c.aclose()


def test_restore_reads_through_the_seam_with_a_folder(tmp_path: pathlib.Path) -> None:
    """The seam passes the folder on; the in-memory test store takes it too."""
    from tests.unit.fakes import MemoryStore

    store: Any = MemoryStore()
    store.write(
        "d",
        kind="k",
        instance="i",
        checkpoint_id="c",
        records=[Record("r", 1)],
        stop=store.new_stop(),
    )
    _, got = store.read("d", kind="k", instance="i", select=lambda _k: True, attachments_dir="x")
    assert [r.key for r in got] == ["r"]


async def test_records_keep_their_attachments_between_a_server_and_its_workers() -> None:
    """The aggregate and its workers exchange records as frames: the
    attachments ride along (an export to the server, an install to a worker)."""
    record = Record("r", {"s": 1}, "v", attachments={"a" * 64: "/sandbox/file"})
    reader = asyncio.StreamReader()
    reader.feed_data(frames.encode({"records": [record]}))
    message = await frames.read_frame(reader)
    assert msgspec.convert(message["records"], list[Record]) == [record]
