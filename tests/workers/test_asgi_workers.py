"""An ASGI (FastAPI) server under a multi-worker host."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from ray_ckpt.hosting.host import ParticipantHost
from ray_ckpt.hosting.spec import ServerSpec
from ray_ckpt.workers.front import FORWARDED_HEADER
from tests.workers.conftest import AUTH, TOKEN, body


async def test_fastapi_workers_close_together_and_the_host_answers_control(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    spec = ServerSpec(
        kind="environment",
        name="fastapi",
        factory="tests.servers:fastapi_server",
        settings={"enabled": True, "control_auth_token": TOKEN, "lease_grace_seconds": 30.0},
        workers=2,
        spreading="shared",
    )
    host = ParticipantHost(spec)
    try:
        await host._ready()
        keys = [f"k{i}" for i in range(24)]

        async def put(key: str) -> int:
            async with http.put(f"{host.url}/episodes/{key}", json={"v": key}) as r:
                await r.read()
                return r.status

        assert set(await asyncio.gather(*(put(k) for k in keys))) == {200}
        assert host.plane is not None
        held = []
        for url in host.plane.pool.urls.values():  # each worker's own table
            async with http.get(f"{url}/episodes", headers={FORWARDED_HEADER: "t"}) as r:
                held.append(len(await r.json()))
        assert sum(held) == len(keys)
        assert min(held) > 0, held  # the shared port spread them over both
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
