"""The coordinator drives hosted, sidecar and HTTP-only participants the same way."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from pydantic import SecretStr

from coordination.cli.inspect import inspect_checkpoint
from coordination.client.connect import connect
from ray_ckpt.gym_server.spec import ServerSpec, settings_dict
from ray_ckpt.hosting.host import start_host, stop_host
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage import read_gym_manifest
from tests.servers import SETTINGS_ENV

pytestmark = pytest.mark.ray

TOKEN = "transport-test-token"
SETTINGS = settings_dict(
    CheckpointSettings(enabled=True, control_auth_token=SecretStr(TOKEN), lease_grace_seconds=60)
)


async def put(url: str, key: str, state: object) -> None:
    async with aiohttp.ClientSession() as http, http.put(f"{url}/episodes/{key}", json=state) as r:
        assert r.status == 200, await r.text()


async def test_three_transports_one_checkpoint(namespace: str, tmp_path: Path) -> None:
    import ray

    # Sidecar: the Gym server is its own OS process; its host forwards control calls.
    env = {**os.environ, SETTINGS_ENV: json.dumps(SETTINGS)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.servers", "--kind", "model",
        "--name", "side", stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    hosts = []
    gym = None
    try:
        assert proc.stdout is not None
        side_url = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().split()[1]
        hosts.append(
            start_host(
                ServerSpec(kind="model", name="side", url=side_url, settings=SETTINGS),
                namespace=namespace,
            )
        )
        # Hosted: the aiohttp app runs inside the ParticipantHost actor.
        hosts.append(
            start_host(
                ServerSpec(
                    kind="environment",
                    name="hosted",
                    factory="tests.servers:aiohttp_server",
                    settings=SETTINGS,
                ),
                namespace=namespace,
            )
        )
        # HTTP only: a FastAPI server the coordinator cannot see as an actor
        # (another namespace); it is registered by URL and token alone.
        far = start_host(
            ServerSpec(
                kind="resources",
                name="far",
                factory="tests.servers:fastapi_server",
                options={"kind": "resources"},
                settings=SETTINGS,
            ),
            namespace=f"{namespace}-far",
        )
        hosts.append(far)
        infos = [await h.ready.remote() for h in hosts]
        urls = {i["name"]: i["url"] for i in infos}
        await put(side_url, "m1", {"tokens": [1, 2]})
        await put(urls["hosted"], "e1", {"next": "verify"})
        await put(urls["far"], "s1", {"board": "x.o"})

        gym = connect(namespace=namespace, state_dir=str(tmp_path / "coord"))
        assert sorted(gym.discover()) == ["environment/hosted", "model/side"]
        gym.register_http("resources", "far", urls["far"], TOKEN)
        transports = {p.participant: p.transport for p in gym.status().participants}
        assert transports == {
            "environment/hosted": "ray",
            "model/side": "ray",
            "resources/far": "http",
        }

        ckpt = tmp_path / "ckpt"
        result = await gym.acheckpoint(str(ckpt))
        assert result.episode_ids == {
            "environment/hosted": ["e1"],
            "model/side": ["m1"],
            "resources/far": ["s1"],
        }
        listed = {(e.kind, e.instance) for e in read_gym_manifest(ckpt).participants}
        assert listed == {("environment", "hosted"), ("model", "side"), ("resources", "far")}
        assert inspect_checkpoint(ckpt).ok
        # Every participant, whatever its transport, was resumed.
        for p in gym.status().participants:
            assert p.phase == "idle", p
        await put(side_url, "m2", {"after": time.time() > 0})
    finally:
        if gym is not None:
            ray.kill(gym.actor, no_restart=True)
        for h in hosts:
            await stop_host(h, timeout_s=5)
        if proc.returncode is None:
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
