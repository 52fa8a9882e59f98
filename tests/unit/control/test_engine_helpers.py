"""The engine's helpers through their own narrow interfaces, and the
engine handing them what is in place at each call.

The helpers (`commit.Commits`, `restore.Restores`, `timing`) never see the
engine: they are given the participant, the store, the clock and
callables.  These tests drive them that way, with a fake participant and an
in-memory store, and check that the engine's replaceable attributes
(`store`, `clock`) still reach work started after they were replaced.
"""

from __future__ import annotations

import asyncio

import pytest

from ray_ckpt import EpisodeId, ManualClock
from ray_ckpt.control.commit import Commits
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.control.restore import Restores
from ray_ckpt.control.timing import LeaseWatcher, ReadinessWait
from ray_ckpt.control.wire import CommitRequest, RestoreRequest, decode_request
from ray_ckpt.errors import InvalidPhase, RestartInScope
from ray_ckpt.settings import CheckpointSettings
from tests.unit.fakes import FakeParticipant, MemoryStore
from tests.unit.helpers import T0, body_t0, until


def engine() -> tuple[ParticipantEngine, FakeParticipant]:
    p = FakeParticipant()
    settings = CheckpointSettings(enabled=True, control_auth_token="t")
    c = ParticipantEngine(
        p, instance="env0", settings=settings, clock=ManualClock(T0), store=MemoryStore()
    )
    return c, p


async def test_a_store_replaced_after_construction_takes_the_sync_commits_write() -> None:
    c, p = engine()
    replaced = MemoryStore()
    c.store = replaced
    c.clock = ManualClock(T0 + 5)
    p.start("r1", at_boundary=True, state={"s": 1})
    await c.handle("prepare", body_t0("c1"))
    reply = await c.handle("commit", body_t0("c1", checkpoint_dir="/ck"))
    assert reply["episode_ids"] == ["r1"]
    assert replaced.data[("/ck", "environment", "env0")][0].checkpoint_id == "c1"
    # The write's slices are in the clock in place, not the one at construction.
    assert {s["name"] for s in reply["spans"]} == {"capture", "write", "release"}
    assert all(s["start"] >= T0 + 5 for s in reply["spans"])


async def test_an_async_commits_write_goes_to_the_store_in_place_at_the_resume() -> None:
    c, p = engine()
    p.start("r1", at_boundary=True, state={"s": 1})
    await c.handle("prepare", body_t0("c1"))
    pending = await c.handle("commit", body_t0("c1", checkpoint_dir="/ck", durability="async"))
    assert pending["pending"] is True
    # The write starts at the resume: a store put in place before then takes it.
    replaced = MemoryStore()
    c.store = replaced
    await c.handle("resume", body_t0("c1"))
    await until(lambda: c.writes_in_flight == 0)
    final = await c.handle("commit", body_t0("c1", checkpoint_dir="/ck", durability="async"))
    assert final["manifest"]["checkpoint_id"] == "c1"
    assert ("/ck", "environment", "env0") in replaced.data


async def test_commits_export_refuses_a_participant_no_longer_ready_or_a_restart_in_scope() -> None:
    p = FakeParticipant()
    commits = Commits(p, instance="env0")
    clock = ManualClock(T0)
    p.start("r1")  # not at a boundary
    req = decode_request("commit", body_t0("c1", checkpoint_dir="/ck"))
    assert isinstance(req, CommitRequest)
    with pytest.raises(InvalidPhase, match="environment/env0 is no longer ready"):
        await commits.export(req, None, MemoryStore(), clock)
    p.reach_boundary("r1")
    p.restarts.add("r1")
    with pytest.raises(RestartInScope, match="r1"):
        await commits.export(req, (EpisodeId("r1"),), MemoryStore(), clock)


async def test_commits_write_and_restores_install_through_what_they_are_given() -> None:
    source = FakeParticipant()
    source.start("r1", at_boundary=True, state="s")
    store, clock = MemoryStore(), ManualClock(T0)
    commits = Commits(source, instance="env0")
    req = decode_request("commit", body_t0("c1", checkpoint_dir="/ck"))
    assert isinstance(req, CommitRequest)
    write = await commits.export(req, None, store, clock)
    manifest = await commits.start(write, req, store, clock)
    assert manifest.record_count == 1

    fenced: list[EpisodeId] = []
    target = FakeParticipant()
    restores = Restores(target, instance="env0", fence=fenced.append)
    restore = decode_request(
        "restore", body_t0("c1", checkpoint_dir="/ck", episode_ids=[{"rollout_id": "r1"}])
    )
    assert isinstance(restore, RestoreRequest)
    got, records = await restores.read(restore, store, clock)
    install = restores.begin(restore, got, records)
    assert [e.capture_key for e in await install.task] == ["r1-a1"]
    # The attempt it replaced is fenced through the callable it was given.
    assert fenced == [EpisodeId("r1")]
    assert target.restored == {"r1-a1": "s"}
    with pytest.raises(InvalidPhase, match="fresh process"):
        await restores.read(restore, store, clock)


async def test_the_readiness_wait_returns_once_its_condition_holds_after_a_notify() -> None:
    ready = ReadinessWait()
    clock = ManualClock(T0)
    done = False
    waiting = asyncio.ensure_future(ready.wait(lambda: done, T0 + 30, clock))
    await asyncio.sleep(0)
    assert not waiting.done()
    done = True
    ready.notify()
    await asyncio.wait_for(waiting, 5)
    # Past its deadline it returns without the condition, and never raises.
    await asyncio.wait_for(ready.wait(lambda: False, T0 - 1, clock), 5)


async def test_the_lease_watcher_checks_once_the_lease_may_have_expired() -> None:
    checks = 0
    left: float | None = None

    async def check() -> bool:
        nonlocal checks
        checks += 1
        return False

    watcher = LeaseWatcher(check, lambda: left)
    watcher.start()
    watcher.start()  # idempotent: one watcher
    left = 0.0
    await until(lambda: checks >= 2)
    await watcher.stop()
    after = checks
    await asyncio.sleep(0.05)
    assert checks == after
