"""The coordinator over a multi-worker host: a lost worker fails the prepare
by name, and the next checkpoint after the resume is whole."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal

import aiohttp
import pytest
import ray

from coordination.client.connect import connect
from ray_ckpt.errors import CoordinationFailed
from ray_ckpt.gym_server.spec import ServerSpec
from ray_ckpt.hosting.host import start_host, stop_host
from ray_ckpt.workers.routing import owner_index

pytestmark = [pytest.mark.ray]


async def test_a_worker_killed_mid_prepare_fails_the_coordinated_prepare_by_name(
    namespace: str, tmp_path: pathlib.Path
) -> None:
    spec = ServerSpec(
        kind="resources",
        name="counter-w",
        factory="participants.servers.counter:counter_server",
        settings={"enabled": True, "control_auth_token": "tok"},
        workers=2,
        spreading="rollout",
    )
    host = start_host(spec, namespace=namespace)
    gym = connect(namespace=namespace, state_dir=str(tmp_path / "state"))
    try:
        info = await asyncio.wait_for(host.ready.remote(), 60)
        await gym.adiscover()
        busy = next(f"r{i}" for i in range(100) if owner_index(f"r{i}", 2) == 1)
        async with aiohttp.ClientSession() as http:
            held = asyncio.ensure_future(
                http.post(f"{info['url']}/ng-rollout/{busy}/step", json={"hold_s": 30})
            )
            await asyncio.sleep(0.5)
            # The prepare waits for the held step; w1 dies while it waits.
            prepare = asyncio.ensure_future(gym.aprepare(deadline_s=3.0))
            await asyncio.sleep(0.5)
            pids = (await host.status.remote())["workers"]["pids"]
            os.kill(pids["w1"], signal.SIGKILL)
            with pytest.raises(CoordinationFailed) as failed:
                await prepare
            # Named, even though its replacement has started (closed) by now.
            assert "worker-lost:w1" in str(failed.value.failures)
            held.cancel()
        await gym.aresume()
        # Replaced and reopened: the next checkpoint is whole.
        for _ in range(100):
            status = await host.status.remote()
            if status["workers"]["reported"] == ["w0", "w1"]:
                break
            await asyncio.sleep(0.1)
        committed = await gym.acheckpoint(str(tmp_path / "c2"))
        assert committed.checkpoint_id
    finally:
        ray.kill(gym.actor, no_restart=True)
        await stop_host(host, timeout_s=10)
