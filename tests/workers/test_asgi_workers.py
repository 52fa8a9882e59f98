"""An ASGI (FastAPI) server under a multi-worker host."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from ray_ckpt.gym_server.spec import ServerSpec
from ray_ckpt.hosting.host import ParticipantHost
from ray_ckpt.workers.front import FORWARDED_HEADER
from tests.workers.conftest import AUTH, TOKEN, body

FORWARDED = {FORWARDED_HEADER: "t"}


def fastapi_on_two_workers(settings: dict[str, Any]) -> ServerSpec:
    """The FastAPI table server, two workers on one shared port."""
    return ServerSpec(
        kind="environment",
        name="fastapi",
        factory="tests.servers:fastapi_server",
        settings=settings,
        workers=2,
        spreading="shared",
    )


async def test_fastapi_workers_close_together_and_the_host_answers_control(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    settings = {"enabled": True, "control_auth_token": TOKEN, "lease_grace_seconds": 30.0}
    host = ParticipantHost(fastapi_on_two_workers(settings))
    try:
        await host._ready()
        keys: list[str] = []

        async def put(key: str) -> int:
            async with http.put(f"{host.url}/episodes/{key}", json={"v": key}) as r:
                await r.read()
                return r.status

        assert host.plane is not None
        for wave in range(5):  # a loaded machine may hand one burst to one worker
            batch = [f"k{wave}-{i}" for i in range(24)]
            keys += batch
            assert set(await asyncio.gather(*(put(k) for k in batch))) == {200}
            held = []
            for url in host.plane.pool.urls.values():  # each worker's own table
                async with http.get(f"{url}/episodes", headers=FORWARDED) as r:
                    held.append(len(await r.json()))
            assert sum(held) == len(keys)
            if min(held) > 0:
                break
        assert min(held) > 0, held  # the shared port reaches both workers
        async with http.get(f"{host.url}/ng-control/v1/checkpoint/status", headers=AUTH) as r:
            assert (await r.json())["workers"]["reported"] == ["w0", "w1"]
        async with http.post(
            f"{host.url}/ng-control/v1/checkpoint/prepare", json=body("c1"), headers=AUTH
        ) as r:
            assert (await r.json())["phase"] == "prepared"
        # Closed on both workers: every put is refused, wherever it lands.
        assert set(await asyncio.gather(*(put(f"x{i}") for i in range(24)))) == {409}
        committed = await host.call("commit", body("c1", checkpoint_dir=str(tmp_path)))
        assert sorted(committed["episode_ids"]) == sorted(keys)  # from both workers
        await host.call("resume", body("c1"))
        for _ in range(100):  # the workers reopen right after the resume answers
            if await put("after") == 200:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("admission never reopened")
    finally:
        await host.stop()


async def test_a_fastapi_worker_waking_to_a_burst_takes_one_connection_at_a_time(
    http: aiohttp.ClientSession,
) -> None:
    """uvicorn's own listener takes every pending connection when its loop
    wakes: the worker back first from CPU work took a whole burst while its
    sibling, free a moment later, got none."""
    host = ParticipantHost(fastapi_on_two_workers({}))  # checkpointing off: just serving
    try:
        await host._ready()
        assert host.plane is not None
        private = list(host.plane.pool.urls.values())

        async def block(url: str, s: float) -> int:
            async with http.get(f"{url}/block", params={"s": str(s)}, headers=FORWARDED) as r:
                assert r.status == 200
                return int((await r.json())["pid"])

        # Both workers' loops are held (one till 0.4 s, the other till 0.8 s)
        # while a burst queues on the shared port; each of its requests then
        # holds a loop for 0.1 s.
        held = [asyncio.ensure_future(block(private[0], 0.4))]
        held.append(asyncio.ensure_future(block(private[1], 0.8)))
        await asyncio.sleep(0.15)
        served_by = await asyncio.gather(*(block(host.url, 0.1) for _ in range(16)))
        await asyncio.gather(*held)
        assert set(served_by) == set(host.plane.pool.pids().values()), served_by
    finally:
        await host.stop()
