"""A host killed while its asynchronous commit is still writing: nothing of that
checkpoint is published, `durable()` fails with the participant named, `LATEST`
still names the previous checkpoint, and a fresh host restores that one."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import aiohttp
import pytest
import ray
from pydantic import SecretStr

from coordination import connect
from coordination.actor.actor_options import COORDINATOR_NAME
from coordination.cli.inspect import inspect_checkpoint
from ray_ckpt.errors import CoordinationFailed
from ray_ckpt.gym_server.spec import ServerSpec, settings_dict
from ray_ckpt.hosting.host import start_host, stop_host
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage import read_gym_manifest

pytestmark = pytest.mark.ray

SPEC = ServerSpec(
    kind="environment",
    name="bigwrite",
    factory="tests.servers:aiohttp_server",
    settings=settings_dict(
        CheckpointSettings(enabled=True, control_auth_token=SecretStr("kill-token"))
    ),
)
CHUNK = "x" * 900_000  # under aiohttp's 1 MiB body limit


async def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint_latest(
    namespace: str, tmp_path: Path
) -> None:
    host = start_host(SPEC, namespace=namespace)
    fresh = None
    root = tmp_path / "root"
    try:
        url = (await host.ready.remote())["url"]
        async with aiohttp.ClientSession() as http:
            async with http.put(f"{url}/episodes/e1", json={"step": 1}) as resp:
                assert resp.status == 200
            gym = connect(namespace=namespace, state_dir=str(tmp_path / "state"))
            first = await gym.acheckpoint(str(root / "ckpt-a"))
            # Enough state that its write surely outlasts the kill below.
            for i in range(200):
                async with http.put(f"{url}/episodes/big{i}", json={"blob": CHUNK}) as resp:
                    assert resp.status == 200
            pending = await gym.acheckpoint(str(root / "ckpt-b"), durability="async")
            ray.kill(host, no_restart=True)  # mid-write: captured, not durable
        with pytest.raises(CoordinationFailed) as info:
            await pending.adurable()
        assert set(info.value.failures) == {"environment/bigwrite"}
        assert not (root / "ckpt-b" / "gym" / "_manifest.json").exists()
        assert inspect_checkpoint(str(root / "ckpt-b")).state == "incomplete"
        assert inspect_checkpoint(str(root / "ckpt-a")).state == "complete"
        assert json.loads((root / "LATEST").read_text())["checkpoint_id"] == first.checkpoint_id
        assert read_gym_manifest(str(root / "ckpt-a")).checkpoint_id == first.checkpoint_id

        fresh = start_host(SPEC, namespace=namespace)
        url = (await fresh.ready.remote())["url"]
        deadline = time.monotonic() + 30
        while True:  # the coordinator finds the fresh host under the same name
            try:
                restored = await gym.arestore(str(root), "latest")
                break
            except CoordinationFailed:
                if time.monotonic() > deadline:
                    raise
        assert restored.source_checkpoint_id == first.checkpoint_id
        assert restored.restored == {"environment/bigwrite": ["e1-a1"]}
        async with aiohttp.ClientSession() as http, http.get(f"{url}/episodes") as resp:
            assert await resp.json() == {"e1-a1": {"step": 1}}
    finally:
        with contextlib.suppress(ValueError):  # the coordinator connect() made
            ray.kill(ray.get_actor(COORDINATOR_NAME, namespace=namespace), no_restart=True)
        if fresh is not None:
            await stop_host(fresh, timeout_s=5)
