"""The coordinator's restore over a multi-worker environment (in-process
workers, `tests.unit.workers.inprocess_workers`) that loses a worker right after its
install: the restore fails whole, the restored attempts are retired
everywhere, everyone is resumed, and the lost attempt is never run from
nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from pydantic import SecretStr

from coordination.engine.order import Member
from coordination.reach.hosts import FakeHost
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import CoordinationFailed, StaleAttempt
from ray_ckpt.identity import EpisodeId
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage.records.record import Record
from ray_ckpt.workers.aggregate import WorkersParticipant
from tests.unit.coordination.coord_fleet import Fleet, make_fleet
from tests.unit.fakes import MemoryStore
from tests.unit.workers.inprocess_workers import (
    TOKEN,
    Hold,
    InProcessPool,
    make_workers_participant,
)

ENV = "environment/env"
SETTINGS = CheckpointSettings(
    enabled=True, control_auth_token=SecretStr(TOKEN), completion_receipts=True
)


def add_workers_env(f: Fleet) -> tuple[WorkersParticipant, InProcessPool]:
    participant, pool = make_workers_participant("environment", 2)
    ctrl = ParticipantEngine(participant, instance="env", settings=SETTINGS, store=f.store)
    f.hosts[ENV] = host = FakeHost(Member.parse(ENV), ctrl, log=f.log)
    f.ctrls[ENV] = ctrl
    f.core.register(host)
    return participant, pool


def owned(pool: InProcessPool, wid: str) -> str:
    return next(r for r in (f"r{i}" for i in range(200)) if pool.owner(r) == wid)


async def test_a_worker_lost_after_the_install_fails_the_coordinated_restore_whole() -> None:
    store = MemoryStore()
    src = make_fleet(("agent/agent",), store=store)
    participant, pool = add_workers_env(src)
    await pool.reported()
    on0, on1 = owned(pool, "w0"), owned(pool, "w1")
    live: list[asyncio.Future[Any]] = []
    for key in (on0, on1):  # one rollout in flight on each worker
        hold, episode = Hold(), EpisodeId(key)
        live.append(
            asyncio.ensure_future(
                pool.data(pool.owner(key), lambda s, e=episode, h=hold: s.run(e, hold=h))
            )
        )
        await hold.reached.wait()
        src.parts["agent/agent"].start(key, at_boundary=True, state={})
    scope = [EpisodeId(on0), EpisodeId(on1)]
    await src.core.checkpoint("/ck", scope)
    await src.ctrls[ENV].aclose()
    await participant.aclose()
    await pool.stop()  # ends the rollouts in flight with their workers
    await asyncio.gather(*live, return_exceptions=True)
    await src.aclose()

    dst = make_fleet(("agent/agent",), store=store)
    participant, pool = add_workers_env(dst)
    await pool.reported()
    install = participant.install

    async def install_then_lose(records: Sequence[Record]) -> list[EpisodeId]:
        installed = await install(records)
        pool.kill("w1", respawn=True)  # OOM-killed before the coordinator resumes
        return installed

    participant.install = install_then_lose  # type: ignore[method-assign]
    try:
        with pytest.raises(CoordinationFailed) as caught:
            await dst.core.restore("/ck", scope)
        assert set(caught.value.failures) == {ENV}
        assert caught.value.failures[ENV]["code"] == "restored_state_lost"
        assert f"{on1}-a1" in caught.value.failures[ENV]["detail"]
        # Undone: the restored attempts retired everywhere, everyone resumed.
        assert sorted(dst.events("retire")) == sorted(["agent/agent", ENV])
        assert set(dst.phases().values()) == {"idle"}
        assert dst.core.open is None
        await pool.reported()
        for key in (on0, on1):
            with pytest.raises(StaleAttempt):
                await pool.data(pool.owner(key), lambda s, k=key: s.run(EpisodeId(k, 1)))
        fresh = await pool.data(pool.owner(on1), lambda s: s.run(EpisodeId(on1, 2)))
        assert fresh["continued"] is False
    finally:
        await dst.ctrls[ENV].aclose()
        await participant.aclose()
        await pool.stop()
        await dst.aclose()


async def test_a_worker_lost_before_a_later_resume_fails_the_restore_left_open() -> None:
    """`restore(resume=False)`, then the worker dies, then the trainer's
    `resume()`: the restore fails whole exactly as when it resumed itself."""
    store = MemoryStore()
    src = make_fleet(("agent/agent",), store=store)
    participant, pool = add_workers_env(src)
    await pool.reported()
    on1 = owned(pool, "w1")
    hold = Hold()
    live = asyncio.ensure_future(
        pool.data(pool.owner(on1), lambda s: s.run(EpisodeId(on1), hold=hold))
    )
    await hold.reached.wait()
    scope = [EpisodeId(on1)]
    await src.core.checkpoint("/ck", scope)
    await src.ctrls[ENV].aclose()
    await participant.aclose()
    await pool.stop()
    await asyncio.gather(live, return_exceptions=True)
    await src.aclose()

    dst = make_fleet(("agent/agent",), store=store)
    participant, pool = add_workers_env(dst)
    await pool.reported()
    try:
        result = await dst.core.restore("/ck", scope, resume=False)
        assert result.restored[ENV] == [f"{on1}-a1"]
        pool.kill("w1", respawn=True)  # OOM-killed before the trainer resumes
        await pool.reported()
        with pytest.raises(CoordinationFailed) as caught:
            await dst.core.resume()
        assert caught.value.failures[ENV]["code"] == "restored_state_lost"
        assert set(dst.phases().values()) == {"idle"}
        assert dst.core.open is None
        await pool.reported()
        with pytest.raises(StaleAttempt):
            await pool.data(pool.owner(on1), lambda s: s.run(EpisodeId(on1, 1)))
    finally:
        await dst.ctrls[ENV].aclose()
        await participant.aclose()
        await pool.stop()
        await dst.aclose()
