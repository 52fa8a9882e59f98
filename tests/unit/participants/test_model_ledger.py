"""The policy model's capture ledger is bounded, scoped and off when checkpointing is.

Rows of finished (closed by the caller), retired and forgotten attempts are
freed; `export` needs a scope (notes §1.10); with checkpointing off nothing is
recorded.  Checked against the real participant, the real engine and the
reference fleet on loopback.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import SecretStr

from participants.fleet import FleetConfig
from participants.local import LocalFleet, start_local_fleet
from participants.policy_model import PolicyModelParticipant
from participants.rollout import make_tasks, run_episode
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import InvalidRequest
from ray_ckpt.identity import EpisodeId
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage.records.record import Record
from tests.unit.helpers import body

EMPTY = {
    "calls": 0,
    "ledgers": 0,
    "ledger_rows": 0,
    "cuts": 0,
    "restored_cuts": 0,
    "restored": 0,
    "finishing": 0,
}


def serve_call(model: PolicyModelParticipant, episode: EpisodeId, position: int) -> None:
    call = model.admit(episode, f"d-{episode.capture_key}-{position}", "p", position=position)
    call.tokens = [position, 1, 2]
    model.deliver(call)
    model.delivered(call, {"call": call.index, "tokens": 3})


async def test_ten_thousand_short_episodes_leave_every_table_as_it_started() -> None:
    model = PolicyModelParticipant()
    collected: dict[str, int] = {}
    model.collect = lambda episode, rows: collected.__setitem__(episode.capture_key, len(rows))
    start = model.table_sizes()
    assert start == EMPTY
    batches, size = 100, 100
    for b in range(batches):
        episodes = [EpisodeId(f"r{b}x{i}") for i in range(size)]
        for position in (0, 1):
            for episode in episodes:
                serve_call(model, episode, position)
        finished, retired, forgotten = episodes[:90], episodes[90:95], episodes[95:]
        if b % 10 == 3:
            # A checkpoint opens while the batch ends: one generation of each
            # episode is cut, and the closes that arrive are kept for the export.
            held = [model.admit(e, f"d-{e.capture_key}-2", "p", position=2) for e in episodes]
            for call in held:
                call.tokens = [7]
            model.close_admission()
            for episode in finished:
                model.finish(episode)
            records = await model.export(episodes)
            assert len(records) == size
            assert all(len(r.state["rows"]) == 2 and r.state["cut"] for r in records)
            model.open_admission()
            for call in held:
                model.drop(call)  # the caller went away
        else:
            for episode in finished:
                model.finish(episode)
        assert await model.retire(retired) == sorted(e.capture_key for e in retired)
        assert model.forget([e.rollout_id for e in forgotten]) == sorted(
            e.capture_key for e in forgotten
        )
    assert model.table_sizes() == start
    # Every finished attempt's rows were handed over once, as they were freed.
    assert len(collected) == batches * 90
    assert set(collected.values()) == {2}


async def test_restored_attempts_are_freed_when_finished_forgotten_or_left_out() -> None:
    model = PolicyModelParticipant()
    notified: list[None] = []
    model.bind(lambda: notified.append(None))
    rows = [{"call": 0, "tokens": 3, "position": 0}]
    cut = {"digest": "d", "tokens": [1], "call": 1, "params": "p"}
    await model.install(
        [
            Record("a", {"rows": rows, "cut": cut}),
            Record("b", {"rows": rows}),
            Record("c", {"rows": rows}),
        ]
    )
    assert model.table_sizes()["restored"] == 3
    model.finish(EpisodeId("a", 1))
    model.forget(["b"])
    notified.clear()
    # A commit whose scope leaves c-a1 out frees it, and says so to waiters.
    assert await model.delete_restored([]) == ["c-a1"]
    assert notified, "delete_restored changed readiness-relevant state without a notify"
    assert model.table_sizes() == EMPTY


async def test_export_requires_a_scope_and_a_refused_commit_changes_nothing(
    tmp_path: Path,
) -> None:
    model = PolicyModelParticipant()
    with pytest.raises(InvalidRequest):
        await model.export(None)
    settings = CheckpointSettings(enabled=True, control_auth_token=SecretStr("t"))
    engine = ParticipantEngine(model, instance="m", settings=settings)
    serve_call(model, EpisodeId("r"), 0)
    assert (await engine.handle("prepare", body("c1")))["phase"] == "prepared"
    where = str(tmp_path / "c1")
    with pytest.raises(InvalidRequest):
        await engine.handle("commit", body("c1", checkpoint_dir=where))
    assert engine.state.phase.value == "prepared"
    assert not (tmp_path / "c1").exists()
    ids = [{"rollout_id": "r", "attempt": 0}]
    reply = await engine.handle("commit", body("c1", checkpoint_dir=where, episode_ids=ids))
    assert reply["episode_ids"] == ["r"]
    # The kind on the wire is NeMo Gym's `model`: in status and in the storage path.
    assert engine.status()["kind"] == "model"
    assert (tmp_path / "c1" / "gym" / "model" / "m").is_dir()
    await engine.handle("resume", body("c1"))
    # The engine's forget frees the rollout's rows with its marks.
    await engine.handle("forget", body("f1", rollout_ids=["r"]))
    assert model.table_sizes() == EMPTY
    await engine.aclose()


TASKS = make_tasks(12, steps=2, seed=8)
QUICK = FleetConfig(tokens_per_turn=3, turns_per_step=1)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def run_all(fleet: LocalFleet, http: aiohttp.ClientSession) -> list[dict[str, Any]]:
    env = fleet.urls["environment"]
    return await asyncio.gather(
        *(run_episode(http, env, EpisodeId(f"e{i}"), t) for i, t in enumerate(TASKS))
    )


async def test_finished_episodes_free_their_ledger_through_the_fleet(
    http: aiohttp.ClientSession,
) -> None:
    fleet = await start_local_fleet(QUICK)
    try:
        model = fleet.server("model").participant
        collected: dict[str, list[Any]] = {}
        model.collect = lambda episode, rows: collected.__setitem__(episode.capture_key, rows)
        start = model.table_sizes()
        replies = await run_all(fleet, http)
        assert all("result" in r for r in replies), replies
        # The environment closes each episode at the agent, which closes it
        # at the model: every row was handed over and freed.
        assert model.table_sizes() == start
        assert sorted(collected) == sorted(f"e{i}" for i in range(len(TASKS)))
        assert all([r["position"] for r in rows] == [0, 1] for rows in collected.values())
    finally:
        await fleet.stop()


async def test_with_checkpointing_off_the_model_records_nothing(
    http: aiohttp.ClientSession,
) -> None:
    fleet = await start_local_fleet(
        FleetConfig(tokens_per_turn=3, turns_per_step=1, checkpoint=False)
    )
    try:
        server = fleet.server("model")
        model = server.participant
        seen: list[int] = []

        async def watch() -> None:
            while True:
                seen.append(sum(len(r) for r in model.ledger.values()))
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        replies = await run_all(fleet, http)
        watcher.cancel()
        assert all("result" in r for r in replies), replies
        assert server.generated > 0
        assert set(seen) == {0}, "a ledger row was recorded with checkpointing off"
        assert model.table_sizes() == EMPTY
    finally:
        await fleet.stop()
