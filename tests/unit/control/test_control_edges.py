"""Edges of the participant's control operations, on one real engine.

A refused call changes nothing (the lease included); `forget` refuses the
reserved attempt suffix like every other route; the asynchronous commit says
which sizes are unknown (null, never 0); a re-sent asynchronous commit naming
another directory is refused; a prepare held by a write in flight answers for
its own ID only; an aborted asynchronous checkpoint's captured write is
discarded, never written.
"""

from __future__ import annotations

import asyncio
import pathlib
import threading
import time
from collections.abc import Sequence
from typing import Any

import orjson
import pytest
from pydantic import SecretStr

from coordination.reach.hosts import FakePauseTarget
from ray_ckpt.clock import SystemClock
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import (
    CheckpointConflict,
    DeadlineExceeded,
    InvalidCheckpointState,
    InvalidRequest,
    RestartInScope,
)
from ray_ckpt.identity import EpisodeId
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage import read_participant
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.seam import FileRecordStore
from tests.unit.coordination.coord_fleet import make_fleet
from tests.unit.fakes import FakeParticipant
from tests.unit.helpers import body

GRACE = 60.0


class GatedStore(FileRecordStore):
    """Real files; each write waits for the gate (a slow disk)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.started = threading.Event()
        self.writes = 0

    def write(self, checkpoint_dir: str, **kw: Any) -> Any:
        self.writes += 1
        self.started.set()
        self.gate.wait(10)
        return super().write(checkpoint_dir, **kw)


class ScopedOnly(FakeParticipant):
    """Exports only a named scope, as the policy model does (its ledger
    holds every episode it ever served)."""

    async def export(self, scope: Sequence[EpisodeId] | None) -> list[Record]:
        if scope is None:
            raise InvalidRequest("this participant exports only a named scope")
        return await super().export(scope)


def make(
    participant: FakeParticipant | None = None,
) -> tuple[ParticipantEngine, FakeParticipant, GatedStore]:
    p = participant or FakeParticipant()
    store = GatedStore()
    settings = CheckpointSettings(
        enabled=True, control_auth_token=SecretStr("t"), lease_grace_seconds=GRACE
    )
    c = ParticipantEngine(
        p, instance="env0", settings=settings, clock=SystemClock(), store=store
    )
    return c, p, store


def fields(c: ParticipantEngine) -> tuple[Any, ...]:
    st = c.status()
    return st["phase"], st["checkpoint_id"], st["lease_expires_at"], st["retired_rollouts"]


# --- 1. a refused request changes nothing, the lease included --------------------------


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_commit_the_model_refuses_leaves_the_lease_where_it_was(
    tmp_path: pathlib.Path, durability: str
) -> None:
    c, p, store = make(ScopedOnly("model"))
    p.start("r1", at_boundary=True, state={"rows": 1})
    await c.handle("prepare", body("c1", deadline=5))
    before = fields(c)
    later = body("c1", deadline=500, checkpoint_dir=str(tmp_path / "ck"), durability=durability)
    with pytest.raises(InvalidRequest, match="named scope"):
        await c.handle("commit", later)
    assert fields(c) == before
    # The refusal left the checkpoint usable: the same commit with a scope goes through.
    store.gate.set()
    reply = await c.handle("commit", {**later, "episode_ids": [{"rollout_id": "r1"}]})
    assert reply["episode_ids"] == ["r1"]
    await c.aclose()


@pytest.mark.parametrize("durability", ["sync", "async"])
async def test_a_commit_naming_a_restart_only_episode_leaves_the_lease_where_it_was(
    tmp_path: pathlib.Path, durability: str
) -> None:
    c, p, _ = make()
    p.start("r1", at_boundary=True, state={})
    p.start("r2", state={})
    p.restarts.add("r2")
    await c.handle("prepare", body("c1", deadline=5))
    before = fields(c)
    scope = [{"rollout_id": "r1"}, {"rollout_id": "r2"}]
    commit = body(
        "c1",
        deadline=500,
        checkpoint_dir=str(tmp_path / "ck"),
        episode_ids=scope,
        durability=durability,
    )
    with pytest.raises(RestartInScope):
        await c.handle("commit", commit)
    assert fields(c) == before
    await c.aclose()


async def test_a_commit_past_its_deadline_is_refused_before_anything_changes(
    tmp_path: pathlib.Path,
) -> None:
    c, p, store = make()
    p.start("r1", at_boundary=True, state={})
    await c.handle("prepare", body("c1", deadline=5))
    before = fields(c)
    for durability in ("sync", "async"):
        with pytest.raises(DeadlineExceeded):
            await c.handle(
                "commit",
                body("c1", deadline=-1, checkpoint_dir=str(tmp_path), durability=durability),
            )
        assert fields(c) == before
    assert store.writes == 0
    await c.aclose()


# --- 2. forget refuses the reserved attempt suffix --------------------------------------


@pytest.mark.parametrize("rollout_id", ["r-a1", "job.7-a12"])
async def test_forget_refuses_a_rollout_id_with_the_reserved_suffix(rollout_id: str) -> None:
    c, _, _ = make()
    await c.handle("retire", body("c0", episode_ids=[{"rollout_id": "r", "attempt": 1}]))
    before = fields(c)
    for sent in (body("c1", rollout_ids=[rollout_id]), body("c1", rollout_ids=["r", rollout_id])):
        with pytest.raises(InvalidRequest, match="reserved"):
            await c.handle("forget", sent)
        # Both transports' decoders (JSON bytes over HTTP, a dict over Ray).
        with pytest.raises(InvalidRequest, match="reserved"):
            await c.handle("forget", orjson.dumps(sent))
    assert fields(c) == before
    # Suffixes that are not the reserved one stay legal.
    legal = ["r", "r-a0", "r-a01", "r-b1"]
    assert (await c.handle("forget", body("c1", rollout_ids=legal)))["forgotten"] == ["r"]
    await c.aclose()


# --- 3. unknown sizes are null, never 0 -------------------------------------------------


async def test_the_pending_reply_says_captured_bytes_is_not_known_yet(
    tmp_path: pathlib.Path,
) -> None:
    c, p, store = make()
    p.start("r1", at_boundary=True, state={"tokens": [1, 2, 3]})
    await c.handle("prepare", body("c1"))
    ck = str(tmp_path / "ck")
    pending = await c.handle("commit", body("c1", checkpoint_dir=ck, durability="async"))
    assert pending["pending"] is True
    assert "captured_bytes" in pending
    assert pending["captured_bytes"] is None
    await c.handle("resume", body("c1"))
    store.gate.set()
    final = await c.handle("commit", body("c1", checkpoint_dir=ck, durability="async"))
    assert isinstance(final["captured_bytes"], int)
    assert final["captured_bytes"] > 0
    await c.aclose()


async def test_an_empty_capture_is_known_at_once(tmp_path: pathlib.Path) -> None:
    c, _, store = make()
    await c.handle("prepare", body("c1"))
    commit = body("c1", checkpoint_dir=str(tmp_path), durability="async")
    pending = await c.handle("commit", commit)
    assert pending["captured_bytes"] == 0
    store.gate.set()
    await c.handle("resume", body("c1"))
    assert (await c.handle("commit", commit))["captured_bytes"] == 0
    await c.aclose()


async def test_the_coordinators_pending_result_has_no_sizes_until_durable() -> None:
    fleet = make_fleet()
    fleet.store.write_gate = threading.Event()
    fleet.core.register_pause(FakePauseTarget("trainer"))
    try:
        fleet.parts["environment/env"].start("r1", at_boundary=True, state={"x": 1})
        result = await fleet.core.checkpoint("/ck", [EpisodeId("r1")], durability="async")
        assert result.pending
        assert set(result.bytes) == set(fleet.parts)
        assert set(result.bytes.values()) == {None}
        assert result.total_bytes is None
        assert fleet.core.last_checkpoint is not None
        assert fleet.core.last_checkpoint.bytes is None
        fleet.store.write_gate.set()
        done = await fleet.core.durable(result.checkpoint_id)
        assert set(done.bytes) == set(fleet.parts)
        # A synchronous checkpoint's figures are known when it returns.
        sync = await fleet.core.checkpoint("/ck2", [EpisodeId("r1")])
        assert None not in sync.bytes.values()
        assert sync.total_bytes == sum(n or 0 for n in sync.bytes.values())
    finally:
        await fleet.aclose()


# --- 4. a re-sent asynchronous commit names the same directory --------------------------


async def test_a_re_sent_async_commit_naming_another_directory_is_refused(
    tmp_path: pathlib.Path,
) -> None:
    c, p, store = make()
    p.start("r1", at_boundary=True, state={"a": 1})
    await c.handle("prepare", body("c1"))
    ck, other = str(tmp_path / "ck"), str(tmp_path / "other")
    await c.handle("commit", body("c1", checkpoint_dir=ck, durability="async"))
    # Before the write ran (not started by the refused re-send) ...
    with pytest.raises(CheckpointConflict):
        await c.handle("commit", body("c1", checkpoint_dir=other, durability="async"))
    scoped = body("c1", checkpoint_dir=ck, durability="async", episode_ids=[{"rollout_id": "r1"}])
    with pytest.raises(CheckpointConflict):
        await c.handle("commit", scoped)
    assert not store.started.is_set()
    await c.handle("resume", body("c1"))
    store.gate.set()
    final = await c.handle("commit", body("c1", checkpoint_dir=ck, durability="async"))
    assert final["manifest"]["checkpoint_id"] == "c1"
    # ... and after it ended: the outcome answers only its own directory.
    with pytest.raises(CheckpointConflict):
        await c.handle("commit", body("c1", checkpoint_dir=other, durability="async"))
    assert not await asyncio.to_thread(pathlib.Path(other).exists)
    await c.aclose()


# --- 5. a busy prepare answers for its own ID -------------------------------------------


async def test_a_prepare_held_by_a_write_answers_for_its_own_checkpoint(
    tmp_path: pathlib.Path,
) -> None:
    c, p, store = make()
    p.start("r1", at_boundary=True, state={"a": 1})
    await c.handle("prepare", body("c1"))
    await c.handle("commit", body("c1", checkpoint_dir=str(tmp_path / "a"), durability="async"))
    await c.handle("resume", body("c1"))
    await asyncio.to_thread(store.started.wait, 5)  # the write runs (gated)

    real_wait = c._background.wait_idle
    others: list[asyncio.Task[dict[str, Any]]] = []
    c3_open = asyncio.Event()

    async def wait_then_move_on(timeout_s: float) -> bool:
        if others:  # c3's prepare: it opened c3 before it waits
            c3_open.set()
            return await real_wait(timeout_s)
        idle = await real_wait(0.01)  # c2 gives up on the write
        # Meanwhile c2 was resumed and c3 opened (its prepare waits too).
        await c.handle("resume", body("c2"))
        others.append(asyncio.ensure_future(c.handle("prepare", body("c3"))))
        await c3_open.wait()
        return idle

    c._background.wait_idle = wait_then_move_on  # type: ignore[method-assign]
    reply = await c.handle("prepare", body("c2"))
    assert (c.state.checkpoint_id, c.state.phase.value) == ("c3", "preparing")
    # c2 is over: not the phase of c3, opened since.
    assert reply["phase"] == "idle"
    assert reply["report"]["blockers"][0] == "write-in-flight:c1"
    store.gate.set()
    assert (await others[0])["phase"] == "prepared"
    await c.aclose()


# --- 6. an aborted asynchronous checkpoint's write is discarded -------------------------


async def test_an_aborting_resume_discards_the_captured_write(tmp_path: pathlib.Path) -> None:
    c, p, store = make()
    store.gate.set()
    p.start("r1", at_boundary=True, state={"a": 1})
    await c.handle("prepare", body("c1"))
    ck = tmp_path / "ck"
    await c.handle("commit", body("c1", checkpoint_dir=str(ck), durability="async"))
    reply = await c.handle("resume", body("c1", abort=True))
    assert reply == {"phase": "idle", "idempotent": False}
    assert p.admission_open
    # Nothing held, nothing running, nothing written.
    assert c.status()["writes_in_flight"] == 0
    assert c.status()["background_write"] is None
    with pytest.raises(InvalidCheckpointState, match="aborted"):
        await c.handle("commit", body("c1", checkpoint_dir=str(ck), durability="async"))
    assert store.writes == 0
    assert not ck.exists()
    # The next checkpoint neither waits for it nor writes it.
    assert (await c.handle("prepare", body("c2")))["phase"] == "prepared"
    assert store.writes == 0
    await c.aclose()


async def test_an_aborting_resume_stops_a_write_a_re_sent_commit_started(
    tmp_path: pathlib.Path,
) -> None:
    c, p, store = make()
    p.start("r1", at_boundary=True, state={"a": 1})
    await c.handle("prepare", body("c1"))
    ck = tmp_path / "ck"
    commit = body("c1", checkpoint_dir=str(ck), durability="async")
    await c.handle("commit", commit)
    # A re-send before the resume starts the write (gated: the disk is slow).
    with pytest.raises(DeadlineExceeded):
        await c.handle("commit", {**commit, "deadline_ts": time.time() + 0.05})
    assert store.started.is_set()
    await c.handle("resume", body("c1", abort=True))
    store.gate.set()
    with pytest.raises(InvalidCheckpointState):
        await c.handle("commit", commit)
    with pytest.raises(InvalidCheckpointState):  # no manifest of c1: nothing published
        read_participant(ck, kind=p.kind, instance="env0", checkpoint_id="c1")
    await c.aclose()


async def test_a_plain_resume_still_writes_and_abort_must_be_a_boolean(
    tmp_path: pathlib.Path,
) -> None:
    c, p, store = make()
    store.gate.set()
    p.start("r1", at_boundary=True, state={"a": 1})
    await c.handle("prepare", body("c1"))
    ck = tmp_path / "ck"
    commit = body("c1", checkpoint_dir=str(ck), durability="async")
    await c.handle("commit", commit)
    for bad in (1, "true", None):
        with pytest.raises(InvalidRequest):
            await c.handle("resume", body("c1", abort=bad))
    assert c.status()["phase"] == "committed"
    await c.handle("resume", body("c1", abort=False))
    final = await c.handle("commit", commit)
    assert final["manifest"]["checkpoint_id"] == "c1"
    _, records = read_participant(ck, kind=p.kind, instance="env0", checkpoint_id="c1")
    assert [(r.key, r.state) for r in records] == [("r1", {"a": 1})]
    await c.aclose()
