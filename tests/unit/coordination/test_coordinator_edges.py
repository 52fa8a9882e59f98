"""Edges of the coordinator's entry points, over in-process participants
(`coord_fleet`: real `ParticipantEngine`s):

- every entry point that opens a checkpoint or a restore first waits for the
  asynchronous checkpoint still publishing, and `LATEST` never moves back to
  a checkpoint opened before the one it names;
- a retry into the directory of a failed checkpoint commits there (the
  leftovers are cleared, on disk and on S3), while a directory holding a
  complete checkpoint is refused before anyone is paused;
- a restore aimed at a running fleet is refused before any participant
  changes anything.
"""

from __future__ import annotations

import pathlib
import pickle
import threading
from typing import Any

import pytest

from coordination.engine.manifests import write_gym_manifest_from_replies
from coordination.engine.roots import ready_for_checkpoint, write_latest_quietly
from coordination.reach.hosts import FakePauseTarget
from ray_ckpt.errors import (
    CheckpointConflict,
    CoordinationFailed,
    InvalidCheckpointState,
    ParticipantNotFresh,
    ParticipantUnavailable,
)
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage import open_location
from ray_ckpt.storage.blobstore.locations import join_location
from ray_ckpt.storage.root.gym_manifest import read_gym_manifest, verify_checkpoint
from ray_ckpt.storage.root.pointer import read_latest
from ray_ckpt.storage.seam import FileRecordStore
from tests.s3_server import local_or_s3_root, s3_endpoint
from tests.unit.coordination.coord_fleet import Fleet, make_fleet

__all__ = ["local_or_s3_root", "s3_endpoint"]  # the fixtures, imported for pytest

# How long a held-back publish waits for the event that would release it
# (only ever reached when the code under test is right and nothing sets it).
HOLD_S = 1.0


# --- 1. a pending asynchronous checkpoint publishes first ---------------------------


def _slow_publish(fleet: Fleet, slow_dir: str, gate: threading.Event) -> list[str]:
    """The Gym manifest of `slow_dir` waits for `gate` (at most HOLD_S);
    returns the order the Gym manifests were written in."""
    writer = fleet.core.manifest_writer
    order: list[str] = []

    def write(d: str, cid: str, ms: list[dict[str, Any]]) -> None:
        if d == slow_dir:
            gate.wait(HOLD_S)
        writer(d, cid, ms)
        order.append(d)

    fleet.core.manifest_writer = write
    return order


async def test_split_prepare_waits_for_the_pending_publish_so_latest_ends_on_the_newer() -> None:
    fleet = make_fleet()
    gate = threading.Event()
    published = _slow_publish(fleet, "/r/a", gate)
    latest = fleet.core.latest_writer
    assert latest is not None

    def latest_then_release(d: str, cid: str) -> None:
        latest(d, cid)
        if d == "/r/b":
            gate.set()  # b went all the way round: let a's late publish land

    fleet.core.latest_writer = latest_then_release
    try:
        a = await fleet.core.checkpoint("/r/a", None, durability="async")
        assert a.pending
        prepared = await fleet.core.prepare()
        # a was published before b opened: its Gym manifest and LATEST are there.
        assert published == ["/r/a"]
        await fleet.core.commit("/r/b")
        await fleet.core.resume()
        await fleet.core.durable(a.checkpoint_id)
        assert published == ["/r/a", "/r/b"]
        assert fleet.latests == [("/r/a", a.checkpoint_id), ("/r/b", prepared.checkpoint_id)]
    finally:
        gate.set()
        await fleet.aclose()


async def test_latest_is_never_moved_back_to_a_checkpoint_opened_before_the_one_it_names(
    tmp_path: pathlib.Path,
) -> None:
    fleet = make_fleet()
    fleet.core.latest_writer = write_latest_quietly  # the real pointer, on disk
    root = str(tmp_path)
    try:
        a = await fleet.core.checkpoint(join_location(root, "a"), None)
        b = await fleet.core.checkpoint(join_location(root, "b"), None)
        assert read_latest(open_location(root)) is not None
        # a's publish arriving late (after b's) leaves the pointer on b.
        await fleet.core._write_latest(join_location(root, "a"), a.checkpoint_id)
        pointer = read_latest(open_location(root))
        assert pointer is not None
        assert (pointer.name, pointer.checkpoint_id) == ("b", b.checkpoint_id)
        # The same checkpoint again, or a newer one, still moves it.
        c = await fleet.core.checkpoint(join_location(root, "c"), None)
        pointer = read_latest(open_location(root))
        assert pointer is not None
        assert (pointer.name, pointer.checkpoint_id) == ("c", c.checkpoint_id)
    finally:
        await fleet.aclose()


async def test_a_latest_writer_that_raises_fails_nothing_and_leaves_nothing_open() -> None:
    fleet = make_fleet()

    def broken(d: str, cid: str) -> None:
        raise RuntimeError("pointer store down (test)")

    fleet.core.latest_writer = broken
    try:
        done = await fleet.core.checkpoint("/ck", None)
        # Complete with its Gym manifest; the pointer is only a hint.
        assert [cid for _, cid, _ in fleet.manifests] == [done.checkpoint_id]
        assert fleet.core.open is None
        assert set(fleet.phases().values()) == {"idle"}
        assert all(p.admission_open for p in fleet.parts.values())
        await fleet.core.checkpoint("/ck2", None)  # the next one is not refused
    finally:
        await fleet.aclose()


async def test_a_restore_waits_for_the_pending_publish() -> None:
    fleet = make_fleet()  # nothing served yet: every member may restore
    restores_before_publish: list[int] = []
    writer = fleet.core.manifest_writer

    def write(d: str, cid: str, ms: list[dict[str, Any]]) -> None:
        restores_before_publish.append(len(fleet.events("restore")))
        writer(d, cid, ms)

    fleet.core.manifest_writer = write
    gate = threading.Event()
    published = _slow_publish(fleet, "/r/a", gate)  # counted once the hold is over
    try:
        a = await fleet.core.checkpoint("/r/a", None, durability="async")
        await fleet.core.restore("/r/a", [])
        assert published == ["/r/a"]
        assert restores_before_publish == [0]  # published before anyone restored
        await fleet.core.durable(a.checkpoint_id)
    finally:
        gate.set()
        await fleet.aclose()


# --- 2. a retry into the same directory ---------------------------------------------


def _file_fleet() -> Fleet:
    """Participants writing real records and manifests; the real Gym manifest."""
    fleet = make_fleet(store=FileRecordStore())  # type: ignore[arg-type]
    fleet.core.manifest_writer = write_gym_manifest_from_replies
    fleet.core.latest_writer = write_latest_quietly
    return fleet


async def test_a_retry_into_the_directory_of_a_failed_checkpoint_commits(root: str) -> None:
    fleet = _file_fleet()
    where = join_location(root, "step-3")
    blobs = open_location(where)
    blobs.replace("notes.txt", b"not a checkpoint's\n")  # not ours: kept
    for key in fleet.parts:
        fleet.parts[key].start("r1", at_boundary=True, state={"at": key})
    fleet.hosts["model/policy"].fail["commit"] = InvalidCheckpointState("ENOSPC (test)")
    try:
        with pytest.raises(CoordinationFailed):
            await fleet.core.checkpoint(where, [EpisodeId("r1")])
        # Every other participant committed there; nothing was published.
        assert any(i.key.endswith("manifest.json") for i in blobs.list("gym"))
        del fleet.hosts["model/policy"].fail["commit"]
        again = await fleet.core.checkpoint(where, [EpisodeId("r1")])
        assert again.continued == ["r1"]
        assert read_gym_manifest(blobs).checkpoint_id == again.checkpoint_id
        assert verify_checkpoint(blobs).ok
        assert blobs.read("notes.txt") == b"not a checkpoint's\n"
    finally:
        await fleet.aclose()


async def test_a_directory_holding_a_complete_checkpoint_is_refused_before_any_pause(
    root: str,
) -> None:
    fleet = _file_fleet()
    trainer = FakePauseTarget("trainer")
    fleet.core.register_pause(trainer)
    where = join_location(root, "step-4")
    try:
        first = await fleet.core.checkpoint(where, None)
        calls = len(fleet.log)
        with pytest.raises(CheckpointConflict, match=r"step-4.*never overwritten"):
            await fleet.core.checkpoint(where, None)
        assert len(fleet.log) == calls  # no participant was called
        assert trainer.paused is None
        assert fleet.core.open is None
        assert read_gym_manifest(open_location(where)).checkpoint_id == first.checkpoint_id
        # The split API: the commit is refused before anyone writes, and the
        # checkpoint stays prepared for a commit elsewhere.
        await fleet.core.prepare()
        commits = len(fleet.events("commit"))
        with pytest.raises(CheckpointConflict):
            await fleet.core.commit(where)
        assert len(fleet.events("commit")) == commits
        assert fleet.core.open is not None
        assert fleet.core.open.phase == "prepared"
        done = await fleet.core.commit(join_location(root, "step-5"))
        await fleet.core.resume()
        assert read_gym_manifest(open_location(join_location(root, "step-5"))).checkpoint_id == (
            done.checkpoint_id
        )
    finally:
        await fleet.aclose()


async def test_a_retry_waits_for_the_pending_checkpoint_writing_into_that_directory(
    tmp_path: pathlib.Path,
) -> None:
    fleet = _file_fleet()
    gate = threading.Event()
    where = str(tmp_path / "step-6")
    _slow_publish(fleet, where, gate)
    try:
        a = await fleet.core.checkpoint(where, None, durability="async")
        # Its records are there, its Gym manifest not yet: clearing them now
        # would publish a broken checkpoint.  The retry waits, then finds it complete.
        with pytest.raises(CheckpointConflict):
            await fleet.core.checkpoint(where, None)
        done = await fleet.core.durable(a.checkpoint_id)
        assert done.checkpoint_id == read_gym_manifest(open_location(where)).checkpoint_id
        assert verify_checkpoint(open_location(where)).ok
    finally:
        gate.set()
        await fleet.aclose()


class GatedStore:
    """The real store, whose writes wait for `gate` (a slow disk)."""

    def __init__(self, gate: threading.Event) -> None:
        self.inner = FileRecordStore()
        self.gate = gate

    def write(self, checkpoint_dir: str, **kw: Any) -> Any:
        self.gate.wait(10)
        return self.inner.write(checkpoint_dir, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_retry_clears_what_the_aborted_checkpoints_late_writes_left(
    tmp_path: pathlib.Path,
) -> None:
    """An asynchronous commit aborted (one reply lost): the resume lets the
    captured writes go, and they land after the retry's first look at the
    directory; its prepare waits for them, and they are cleared before its commit."""
    gate = threading.Event()
    fleet = make_fleet(store=GatedStore(gate))  # type: ignore[arg-type]
    fleet.core.manifest_writer = write_gym_manifest_from_replies
    where = str(tmp_path / "step-7")
    host = fleet.hosts["model/policy"]
    real_call = host.call
    lost: list[str] = []

    async def lose_the_commit_reply(op: str, body: Any) -> dict[str, Any]:
        reply = await real_call(op, body)
        if op == "commit" and not lost:
            lost.append(op)
            raise ParticipantUnavailable("the reply to commit was lost (test)")
        return reply

    host.call = lose_the_commit_reply  # type: ignore[method-assign]
    guard = fleet.core.directory_guard
    assert guard is not None

    looks: list[str] = []

    def guard_then_let_writes_land(d: str) -> None:
        guard(d)
        looks.append(d)
        if len(looks) == 2:  # the retry's look before its prepare
            gate.set()

    fleet.core.directory_guard = guard_then_let_writes_land
    for key in fleet.parts:
        fleet.parts[key].start("r1", at_boundary=True, state={"at": key})
    try:
        with pytest.raises(CoordinationFailed):
            await fleet.core.checkpoint(where, [EpisodeId("r1")], durability="async")
        assert not gate.is_set()  # the released writes wait: nothing there yet
        again = await fleet.core.checkpoint(where, [EpisodeId("r1")])
        assert read_gym_manifest(where).checkpoint_id == again.checkpoint_id
        assert verify_checkpoint(where).ok
    finally:
        gate.set()
        await fleet.aclose()


def test_ready_for_checkpoint_clears_only_what_a_checkpoint_wrote(root: str) -> None:
    where = join_location(root, "x")
    blobs = open_location(where)
    blobs.replace("gym/agent/a0/manifest.json", b"{}")
    blobs.replace("gym/agent/a0/records-1.msgpack", b"x")
    blobs.replace("gymnasium.txt", b"kept")
    ready_for_checkpoint(where)
    assert [i.key for i in blobs.list()] == ["gymnasium.txt"]
    ready_for_checkpoint(join_location(root, "absent"))  # nothing there: nothing to do


# --- 3. a restore aimed at a running fleet ------------------------------------------


async def _checkpointed_store() -> Any:
    f = make_fleet()
    for key in f.parts:
        f.parts[key].start("r1", at_boundary=True, state={"at": key})
    await f.core.checkpoint("/ck", [EpisodeId("r1")])
    await f.aclose()
    return f.store


async def test_a_restore_aimed_at_a_live_fleet_is_refused_and_changes_nothing() -> None:
    store = await _checkpointed_store()
    fleet = make_fleet(store=store)
    # The running fleet: r1 (the checkpoint's own rollout) is in flight at
    # two members, the others have served and finished theirs.
    fleet.parts["environment/env"].start("r1", state={"step": 4})
    fleet.parts["agent/agent"].start("r1", state={"step": 4})
    fleet.parts["model/policy"].served = True
    try:
        with pytest.raises(ParticipantNotFresh) as info:
            await fleet.core.restore("/ck", [EpisodeId("r1")])
        assert info.value.code == "not_fresh"
        for key in ("environment/env", "agent/agent", "model/policy"):
            assert key in info.value.detail
        assert "resources/res" not in info.value.detail
        # Nobody was called: nothing retired, nothing paused, nothing open.
        assert [c for h in fleet.hosts.values() for c in h.calls] == []
        assert fleet.core.open is None
        assert fleet.core.journal.load() is None
        assert all(p.admission_open for p in fleet.parts.values())
        assert all(p.retired_keys == [] for p in fleet.parts.values())
        assert set(fleet.phases().values()) == {"idle"}
        # The rollout in flight goes on and is checkpointed as before.
        fleet.parts["environment/env"].reach_boundary("r1", {"step": 5})
        fleet.parts["agent/agent"].reach_boundary("r1", {"step": 5})
        done = await fleet.core.checkpoint("/ck2", [EpisodeId("r1")])
        assert done.continued == ["r1"]
    finally:
        await fleet.aclose()


async def test_a_member_that_restored_once_is_not_fresh_for_another_restore() -> None:
    store = await _checkpointed_store()
    fleet = make_fleet(store=store)
    try:
        await fleet.core.restore("/ck", [EpisodeId("r1")])
        with pytest.raises(ParticipantNotFresh):
            await fleet.core.restore("/ck", [EpisodeId("r1")])
        assert sorted(fleet.events("restore")) == sorted(fleet.parts)  # the first one's only
        assert fleet.core.open is None
    finally:
        await fleet.aclose()


async def test_a_status_without_freshness_leaves_the_check_to_the_participant() -> None:
    """NeMo Gym's participants say nothing of it: their own refusal stands."""
    store = await _checkpointed_store()
    fleet = make_fleet(store=store)
    real = fleet.ctrls["model/policy"].status

    def status() -> dict[str, Any]:
        out = real()
        del out["fresh"], out["live_executions"]
        return out

    fleet.ctrls["model/policy"].status = status  # type: ignore[method-assign]
    try:
        res = await fleet.core.restore("/ck", [EpisodeId("r1")])
        assert res.continued == ["r1"]
    finally:
        await fleet.aclose()


def test_the_refusal_crosses_ray_typed() -> None:
    err = ParticipantNotFresh("agent/agent has 1 executions live")
    rebuilt = pickle.loads(pickle.dumps(err))  # as Ray carries an actor's error
    assert isinstance(rebuilt, ParticipantNotFresh)
    assert rebuilt.code == "not_fresh"
    assert rebuilt.http_status == 409
