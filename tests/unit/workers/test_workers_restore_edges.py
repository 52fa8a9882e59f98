"""A multi-worker server meeting a restore: losses between install and resume,
completion receipts across admission changes, an install failing on one
worker.  The real engine, the real `WorkersParticipant` and the real
worker runtimes, in one process (`tests.unit.workers.inprocess_workers`); a kill is
the loss of a worker and everything it held.  `tests/workers/
test_workers_restore_edges.py` runs the loss cases with real processes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from pydantic import SecretStr

from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import (
    InvalidCheckpointState,
    ParticipantUnavailable,
    ReceiptsOff,
    RestoredStateLost,
    StaleAttempt,
)
from ray_ckpt.identity import EpisodeId
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage.records.record import Record
from ray_ckpt.workers.aggregate import WorkersParticipant
from tests.unit.fakes import MemoryStore
from tests.unit.helpers import body
from tests.unit.workers.inprocess_workers import (
    TOKEN,
    Hold,
    InProcessPool,
    held_of,
    make_workers_participant,
)

SETTINGS = CheckpointSettings(
    enabled=True, control_auth_token=SecretStr(TOKEN), completion_receipts=True
)
CK = "/ck"


class Env:
    """One two-worker environment server under its engine."""

    def __init__(self, store: MemoryStore, *, receipts: bool = True) -> None:
        self.participant, self.pool = make_workers_participant(
            "environment", 2, completion_receipts=receipts
        )
        self.ctl = ParticipantEngine(
            self.participant, instance="env0", settings=SETTINGS, store=store
        )

        self.live: list[asyncio.Task[Any]] = []

    async def call(self, op: str, **kw: Any) -> dict[str, Any]:
        return await self.ctl.handle(op, kw)

    async def resume(self, cid: str) -> dict[str, Any]:
        """Resume, and wait for the workers to reopen (they do right after
        the resume answers; over processes callers retry `admission_closed`)."""
        reply = await self.call("resume", **body(cid))
        await self.pool.reported()
        return reply

    async def hold(self, key: str, steps: int) -> Hold:
        """A rollout in flight: `steps` steps, then live at its boundary."""
        hold = Hold()
        self.live.append(asyncio.ensure_future(self.run(key, steps=steps, hold=hold)))
        await hold.reached.wait()
        return hold

    async def run(self, key: str, **kw: Any) -> dict[str, Any]:
        """A data call of attempt `key`, on the worker its rollout routes to."""
        return await self.run_on(
            self.pool.owner(EpisodeId.from_capture_key(key).rollout_id), key, **kw
        )

    async def run_on(self, wid: str, key: str, **kw: Any) -> dict[str, Any]:
        episode = EpisodeId.from_capture_key(key)
        reply: dict[str, Any] = await self.pool.data(wid, lambda s: s.run(episode, **kw))
        return reply

    async def aclose(self) -> None:
        for task in self.live:
            task.cancel()
        await asyncio.gather(*self.live, return_exceptions=True)
        await self.ctl.aclose()
        await self.participant.aclose()
        await self.pool.stop()


def owned_by(pool: InProcessPool, wid: str, n: int = 1) -> list[str]:
    return [r for r in (f"r{i}" for i in range(200)) if pool.owner(r) == wid][:n]


@pytest.fixture
async def envs() -> AsyncIterator[list[Env]]:
    made: list[Env] = []
    yield made
    for env in reversed(made):
        await env.aclose()


async def checkpoint(envs: list[Env], store: MemoryStore) -> tuple[list[str], list[str]]:
    """A checkpoint at CK of a source server: one live rollout on each worker
    (two steps in) and one finished, unacknowledged result on each worker.
    Returns (live rollouts by worker w0, w1; finished rollouts w0, w1)."""
    src = Env(store)
    envs.append(src)
    await src.pool.reported()
    live0, done0 = owned_by(src.pool, "w0", 2)
    live1, done1 = owned_by(src.pool, "w1", 2)
    for key in (live0, live1):
        await src.hold(key, steps=2)
    for key in (done0, done1):
        assert "receipt" in await src.run(key, finish=True)
    assert (await src.call("prepare", **body("c0")))["phase"] == "prepared"
    committed = await src.call("commit", **body("c0", checkpoint_dir=CK))
    assert sorted(committed["episode_ids"]) == sorted([live0, live1])
    await src.resume("c0")
    return [live0, live1], [done0, done1]


async def restored_env(envs: list[Env], store: MemoryStore, live: list[str]) -> Env:
    dst = Env(store)
    envs.append(dst)
    await dst.pool.reported()
    scope = [msgspec.to_builtins(EpisodeId(r)) for r in live]
    reply = await dst.call("restore", **body("x1", checkpoint_dir=CK, episode_ids=scope))
    assert sorted(reply["restored"]) == sorted(f"{r}-a1" for r in live)
    return dst


# --- item 4: the in-process pool itself -------------------------------------------------


async def test_an_export_with_a_worker_lost_fails_the_checkpoint_whole(envs: list[Env]) -> None:
    env = Env(MemoryStore())
    envs.append(env)
    await env.pool.reported()
    for wid in ("w0", "w1"):
        await env.hold(owned_by(env.pool, wid)[0], steps=1)
    assert (await env.call("prepare", **body("c1")))["phase"] == "prepared"
    exporting = env.pool.server("w1").participant
    exporting.gate, exporting.exporting = asyncio.Event(), asyncio.Event()
    commit = asyncio.ensure_future(env.call("commit", **body("c1", checkpoint_dir=CK)))
    await exporting.exporting.wait()
    env.pool.kill("w1", respawn=True)  # mid-export: its episode is gone from c1
    with pytest.raises(ParticipantUnavailable):
        await commit
    assert env.ctl.store.data == {}  # type: ignore[attr-defined]
    await env.resume("c1")
    # The replacement serves; the next checkpoint is whole again.
    [fresh] = owned_by(env.pool, "w1", 2)[1:]
    await env.hold(fresh, steps=1)
    assert (await env.call("prepare", **body("c2")))["phase"] == "prepared"
    committed = await env.call("commit", **body("c2", checkpoint_dir=CK))
    assert fresh in committed["episode_ids"]
    await env.resume("c2")


# --- item 1: restored state lost with its worker ----------------------------------------


async def test_a_worker_lost_between_install_and_resume_fails_the_resume_typed(
    envs: list[Env],
) -> None:
    store = MemoryStore()
    (live0, live1), _ = await checkpoint(envs, store)
    dst = await restored_env(envs, store, [live0, live1])
    dst.pool.kill("w1", respawn=True)  # OOM-killed before the coordinator resumes
    with pytest.raises(RestoredStateLost) as caught:
        await dst.call("resume", **body("x1"))
    assert caught.value.code == "restored_state_lost"
    assert f"w1: {live1}-a1" in caught.value.detail
    assert live0 not in caught.value.detail  # w0 still holds its episode
    assert dst.ctl.status()["phase"] == "restored"  # admission stays closed
    # The replacement holds nothing: the restored attempt is fenced there.
    with pytest.raises(StaleAttempt):
        await dst.run(f"{live1}-a1")
    # A retried resume is refused the same way: the loss is not forgotten.
    with pytest.raises(RestoredStateLost):
        await dst.call("resume", **body("x1"))
    # The coordinator's undo: retire the restored attempts, then resume.
    scope = [msgspec.to_builtins(EpisodeId(r, 1)) for r in (live0, live1)]
    await dst.call("retire", **body("x1", episode_ids=scope))
    assert (await dst.resume("x1"))["phase"] == "idle"
    # Each rollout starts over under a new attempt.
    assert (await dst.run(f"{live1}-a2"))["continued"] is False


async def test_a_worker_lost_after_the_resume_fences_the_restored_attempts_it_held(
    envs: list[Env],
) -> None:
    store = MemoryStore()
    (live0, live1), _ = await checkpoint(envs, store)
    dst = await restored_env(envs, store, [live0, live1])
    assert (await dst.resume("x1"))["phase"] == "idle"
    dst.pool.kill("w1", respawn=True)  # before the first call of the restored attempt
    with pytest.raises(StaleAttempt):
        await dst.run(f"{live1}-a1")
    # Every worker refuses it, not only the replacement (the mark is broadcast).
    await asyncio.sleep(0)
    with pytest.raises(StaleAttempt):
        await dst.run_on("w0", f"{live1}-a1")
    # The other worker's restored episode continues.
    reply = await dst.run(f"{live0}-a1")
    assert (reply["continued"], reply["steps"]) == (True, 3)


async def test_a_worker_lost_that_held_no_restored_episode_does_not_fail_the_resume(
    envs: list[Env],
) -> None:
    store = MemoryStore()
    (_, live1), _ = await checkpoint(envs, store)
    dst = await restored_env(envs, store, [live1])  # only w1 holds a restored episode
    dst.pool.kill("w0", respawn=True)
    assert (await dst.resume("x1"))["phase"] == "idle"
    reply = await dst.run(f"{live1}-a1")
    assert (reply["continued"], reply["steps"]) == (True, 3)


# --- item 2: receipts are configuration, not this generation's reports ------------------


async def test_restored_results_are_collected_and_acked_right_after_the_resume(
    envs: list[Env],
) -> None:
    store = MemoryStore()
    (live0, live1), (done0, done1) = await checkpoint(envs, store)
    dst = await restored_env(envs, store, [live0, live1])
    assert (await dst.call("resume", **body("x1")))["phase"] == "idle"
    # The README's pattern: resume, then collect and ack what the workers hold.
    got = await dst.call("collect")
    assert got["completion_receipts"] is True
    assert sorted(item["receipt"]["rollout_id"] for item in got["results"]) == sorted(
        [done0, done1]
    )
    acked = await dst.call("ack", receipts=[item["receipt"] for item in got["results"]])
    assert len(acked["acknowledged"]) == 2
    assert held_of(dst.pool, "w0") == held_of(dst.pool, "w1") == []


async def test_receipts_stay_on_across_every_close_and_open(envs: list[Env]) -> None:
    env = Env(MemoryStore())
    envs.append(env)
    await env.pool.reported()
    [key] = owned_by(env.pool, "w1")
    receipt = (await env.run(key, finish=True))["receipt"]
    await env.call("prepare", **body("c1"))  # a close: a generation nobody reported at yet
    status = env.ctl.status()
    assert (status["completion_receipts"], status["unacknowledged_results"]) == (True, 1)
    assert len((await env.call("collect"))["results"]) == 1
    await env.call("resume", **body("c1"))  # an open
    assert (await env.call("ack", receipts=[receipt]))["acknowledged"] == [receipt]


async def test_workers_without_receipts_stay_off(envs: list[Env]) -> None:
    env = Env(MemoryStore(), receipts=False)
    envs.append(env)
    await env.pool.reported()
    assert (await env.call("collect"))["completion_receipts"] is False
    with pytest.raises(ReceiptsOff):
        await env.call("ack", receipts=[{"rollout_id": "r1", "attempt": 0, "digest": "0" * 64}])


# --- item 3: a failed install installs nothing, held results included -------------------


async def test_an_install_failing_on_one_worker_leaves_no_result_on_the_others(
    envs: list[Env],
) -> None:
    store = MemoryStore()
    (live0, live1), _ = await checkpoint(envs, store)
    manifest, records = store.data[(CK, "environment", "env0")]
    # w1's episode record is broken: its worker refuses the install.
    broken = [Record(r.key, "not an episode") if r.key == live1 else r for r in records]
    store.data[(CK, "environment", "env0")] = (manifest, broken)
    dst = Env(store)
    envs.append(dst)
    await dst.pool.reported()
    scope = [msgspec.to_builtins(EpisodeId(r)) for r in (live0, live1)]
    with pytest.raises(InvalidCheckpointState):
        await dst.call("restore", **body("x1", checkpoint_dir=CK, episode_ids=scope))
    # w0's install of its result succeeded before w1 refused: undone.
    assert held_of(dst.pool, "w0") == []
    assert held_of(dst.pool, "w1") == []
    assert (await dst.call("collect"))["results"] == []
    assert isinstance(dst.participant, WorkersParticipant)
    assert dst.participant.restored_lost() == {}
    # Nothing restored either: w0's episode is not there to continue.
    await dst.pool.reported()  # reopened right after the failed restore answered
    assert (await dst.run(f"{live0}-a1"))["continued"] is False
