"""The reference coding environment (`participants.servers.coding`), over real loopback HTTP.

Real sandboxes (`DirectorySandbox` under `tmp_path`), real Python processes,
real episode tables; the checkpoint's hooks are called in process, in the
engine's order, and the "crash" abandons the server whole (its sandboxes'
processes killed, its root given up).  The process-level crash test is
tests/e2e/test_crash_sandbox.py.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from participants.rollout import run_episode
from participants.sandboxes import LIVE_PROCESS
from participants.servers.coding import (
    FUNCTIONS,
    CodingServer,
    coding_server,
    patch_of,
    project_files,
)
from ray_ckpt.identity import EpisodeId
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage.records.record import Record
from tests.unit.conftest import Serve
from tests.unit.helpers import until

TASKS = {
    "r0": {"task_id": "c0", "seed": 40, "steps": 3},
    "r1": {"task_id": "c1", "seed": 41, "steps": 3, "background": True},
    "r2": {"task_id": "c2", "seed": 42, "steps": 3},
}

Make = Callable[..., CodingServer]


@pytest.fixture
async def servers(tmp_path: Path) -> AsyncIterator[Make]:
    made: list[CodingServer] = []

    def make(name: str, **options: Any) -> CodingServer:
        server = coding_server(
            name=name, settings=CheckpointSettings(), root=str(tmp_path / name), **options
        )
        made.append(server)
        return server

    yield make
    for server in made:
        await server.aclose()  # frees its sandboxes, kills their processes


async def run_all(
    http: aiohttp.ClientSession, url: str, tasks: dict[str, dict[str, Any]], attempt: int = 0
) -> dict[str, dict[str, Any]]:
    replies = await asyncio.gather(
        *(run_episode(http, url, EpisodeId(r, attempt), t) for r, t in tasks.items())
    )
    return {r: reply["result"] for r, reply in zip(tasks, replies, strict=True)}


def keep_files(record: Record, where: Path) -> Record:
    """The record as a restore gets it back: its files copied out of the server."""
    where.mkdir(exist_ok=True)
    kept = {}
    for digest, path in (record.attachments or {}).items():
        shutil.copyfile(path, where / digest)
        kept[digest] = str(where / digest)
    return Record(record.key, record.state, record.version, kept)


def test_the_agent_fixes_some_tests_and_not_others_by_seed() -> None:
    patches = {patch_of(seed, step) for seed in range(20) for step in range(1, 5)}
    assert {v for _, v in patches} == {"right", "wrong"}
    assert {n for n, _ in patches} == set(FUNCTIONS)
    files = project_files()
    assert set(files) == {"calc.py", "test_calc.py", "NOTES.md"}
    assert all(f"# == {name} ==" in files["calc.py"] for name in FUNCTIONS)


async def test_episodes_are_rewarded_by_their_tests_and_leave_equal_files_each_run(
    serve: Serve, http: aiohttp.ClientSession, servers: Make
) -> None:
    one = await run_all(http, await serve(servers("one").app()), TASKS)
    two = await run_all(http, await serve(servers("two").app()), TASKS)

    assert one == two
    rewards = {r: res["reward"] for r, res in one.items()}
    assert len(set(rewards.values())) > 1, rewards  # seeds decide, rewards differ
    for result in one.values():
        assert set(result["tests"]) == {f"test_{n}" for n in FUNCTIONS}
        passed = sum(o == "ok" for o in result["tests"].values())
        assert result["reward"] == passed / len(FUNCTIONS)
        assert {"calc.py", "test_calc.py", "results.txt", "out/step_3.txt"} <= set(result["files"])
    assert one["r1"]["files"].keys() >= {"bg.txt", "stop-bg"}
    assert "bg.txt" not in one["r0"]["files"]


async def test_a_bad_task_is_refused_before_anything_begins(
    serve: Serve, http: aiohttp.ClientSession, servers: Make
) -> None:
    server = servers("bad")
    url = await serve(server.app())
    for task in (
        {"task_id": "c", "seed": 1, "steps": 2, "background": "yes"},
        {"task_id": "c", "seed": 1, "steps": 65},
    ):
        payload = {"episode_id": {"rollout_id": "r", "attempt": 0}, "task": task}
        async with http.post(f"{url}/run", json=payload) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "invalid_request"
    assert server.steps.fresh()
    assert server.stats()["sandboxes"] == 0


async def test_a_checkpoint_mid_flight_continues_every_episode_to_the_same_files_and_reward(
    serve: Serve, http: aiohttp.ClientSession, servers: Make, tmp_path: Path
) -> None:
    expected = await run_all(http, await serve(servers("uninterrupted").app()), TASKS)

    first = servers("first", step_delay_s=0.15)
    url = await serve(first.app())
    driving = {
        r: asyncio.ensure_future(run_episode(http, url, EpisodeId(r), t)) for r, t in TASKS.items()
    }
    # Mid-flight: the background process runs, every episode is past setup.
    await until(lambda: first.stats().get("background_started", 0) == 1)
    await until(lambda: first.stats()["steps"] >= 5)
    part = first.participant
    part.close_admission()
    await until(part.ready)
    report = part.report(10)
    assert report.restarts == ["r1"]
    assert first.stats()["sandbox_restarts"] == {"r1": LIVE_PROCESS}
    records = await part.export([EpisodeId("r0"), EpisodeId("r2")])
    assert [r.key for r in records] == ["r0", "r2"]
    assert all(r.attachments for r in records)
    # The checkpoint keeps the files (as storage does: a copy per digest).
    records = [keep_files(r, tmp_path / "ckpt") for r in records]
    # The crash: the driver's calls are gone, so is the server and its
    # sandboxes (its parked handlers end as a dead process's would).
    for call in driving.values():
        call.cancel()
    await asyncio.gather(*driving.values(), return_exceptions=True)
    await part.retire([EpisodeId(r) for r in TASKS])
    await first.aclose()

    second = servers("second")
    installed = await second.participant.install(records)
    assert sorted(e.capture_key for e in installed) == ["r0-a1", "r2-a1"]
    url = await serve(second.app())
    # Attempt 1 of each: r0, r2 from their sandboxes; r1 over from its task.
    results = await run_all(http, url, TASKS, attempt=1)

    assert results == expected
    stats = second.stats()
    assert stats["sandboxes_created"] == 1  # only the restart made a new one
    assert stats["sandboxes"] == 0  # every finished episode's sandbox is freed
