"""ParticipantHost on the shared local Ray: hosted aiohttp and FastAPI servers,
control over HTTP and over Ray methods, placement, graceful stop, kill and restore."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import SecretStr

from ray_ckpt.control.client import ControlClient
from ray_ckpt.control.routes import CHECKPOINT_ROUTE_PREFIX
from ray_ckpt.errors import (
    CheckpointConflict,
    InvalidPhase,
    NotFound,
    StaleCheckpoint,
    Unauthorized,
)
from ray_ckpt.gym_server.spec import ServerSpec, current_node_id, settings_dict
from ray_ckpt.hosting.host import get_host, start_host, stop_host
from ray_ckpt.settings import CheckpointSettings
from tests.actors import until_dead

pytestmark = pytest.mark.ray

TOKEN = "host-test-token"
FACTORIES = {
    "aiohttp": "tests.servers:aiohttp_server",
    "fastapi": "tests.servers:fastapi_server",
}
Start = Callable[..., Awaitable[tuple[Any, dict[str, Any]]]]


def spec_for(name: str, flavour: str, *, enabled: bool = True) -> ServerSpec:
    settings = (
        CheckpointSettings(enabled=True, control_auth_token=SecretStr(TOKEN))
        if enabled
        else CheckpointSettings()
    )
    return ServerSpec(
        kind="environment", name=name, factory=FACTORIES[flavour], settings=settings_dict(settings)
    )


def body(cid: str, **extra: Any) -> dict[str, Any]:
    return {"checkpoint_id": cid, "deadline_ts": time.time() + 20, **extra}


@pytest.fixture
async def start(namespace: str) -> AsyncIterator[Start]:
    """Start hosts in this test's namespace; every one is stopped afterwards."""
    handles: list[Any] = []

    async def go(spec: ServerSpec, **options: Any) -> tuple[Any, dict[str, Any]]:
        handle = start_host(spec, namespace=namespace, **options)
        handles.append(handle)
        return handle, await handle.ready.remote()

    yield go
    for handle in handles:
        await stop_host(handle, timeout_s=10)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def control(url: str) -> ControlClient:
    return ControlClient(url, token=TOKEN, limit=4, limit_per_host=2)


@pytest.mark.parametrize("flavour", ["aiohttp", "fastapi"])
async def test_hosted_app_serves_data_and_guarded_control_on_one_port(
    start: Start, http: aiohttp.ClientSession, flavour: str
) -> None:
    _handle, info = await start(spec_for(f"echo-{flavour}", flavour))
    assert info["kind"] == "environment"
    assert info["name"] == f"echo-{flavour}"
    assert info["port"] > 0
    assert info["url"] == f"http://127.0.0.1:{info['port']}"
    assert info["pid"] != os.getpid()
    assert info["node_id"] == current_node_id()

    async with http.get(f"{info['url']}/echo", params={"msg": "hi"}) as resp:
        assert resp.status == 200
        assert await resp.json() == {"echo": "hi", "server": f"echo-{flavour}"}

    status_url = f"{info['url']}{CHECKPOINT_ROUTE_PREFIX}/status"
    async with http.get(status_url) as resp:
        assert resp.status == 401
        assert (await resp.json())["error"]["code"] == "unauthorized"
    async with http.get(status_url, headers={"Authorization": "Bearer wrong"}) as resp:
        assert resp.status == 401
    async with http.post(
        f"{info['url']}{CHECKPOINT_ROUTE_PREFIX}/prepare", json=body("c-noauth")
    ) as resp:
        assert resp.status == 401
    async with http.get(status_url, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
        assert resp.status == 200
        status = await resp.json()
    # The refused prepare changed nothing.
    assert status["phase"] == "idle"
    assert status["checkpoint_id"] is None
    assert status["instance"] == f"echo-{flavour}"


@pytest.mark.parametrize("flavour", ["aiohttp", "fastapi"])
async def test_disabled_checkpointing_mounts_no_control_routes(
    start: Start, http: aiohttp.ClientSession, flavour: str
) -> None:
    handle, info = await start(spec_for(f"plain-{flavour}", flavour, enabled=False))
    assert info["checkpointing"] is False
    async with http.get(
        f"{info['url']}{CHECKPOINT_ROUTE_PREFIX}/status",
        headers={"Authorization": f"Bearer {TOKEN}"},
    ) as resp:
        assert resp.status == 404
    async with http.get(f"{info['url']}/echo", params={"msg": "x"}) as resp:
        assert (await resp.json())["echo"] == "x"
    # The Ray methods refuse the same way, as a typed error.
    with pytest.raises(NotFound) as caught:
        await handle.prepare.remote(body("c1"))
    assert isinstance(caught.value.cause, NotFound)  # type: ignore[attr-defined]


async def test_ray_methods_and_http_routes_drive_the_same_controller(
    start: Start, http: aiohttp.ClientSession
) -> None:
    handle, info = await start(spec_for("shared", "aiohttp"))
    url = info["url"]
    async with http.put(f"{url}/episodes/r1", json={"s": 1}) as resp:
        assert resp.status == 200
    async with control(url) as client:
        prepare = body("c1")
        by_ray = await handle.prepare.remote(prepare)
        assert by_ray["phase"] == "prepared"
        # The same call over HTTP is answered from the same engine's cache.
        assert await client.call("prepare", prepare) == by_ray
        assert await client.status() == await handle.status.remote()
        assert (await client.status())["checkpoint_id"] == "c1"

        # Admission is closed for data calls while the checkpoint is open.
        async with http.put(f"{url}/episodes/r2", json={"s": 2}) as resp:
            assert resp.status == 409
            assert (await resp.json())["error"]["code"] == "admission_closed"

        # A second checkpoint over HTTP conflicts with the one opened over Ray.
        with pytest.raises(Exception, match="checkpoint_conflict"):
            await client.call("prepare", body("c2"))

        resumed = await client.call("resume", body("c1"))
        assert resumed["phase"] == "idle"
        assert (await handle.status.remote())["phase"] == "idle"

        # Fencing holds across transports: the ID resumed over HTTP is stale over Ray.
        with pytest.raises(StaleCheckpoint) as caught:
            await handle.commit.remote(body("c1", checkpoint_dir="/tmp/never"))
        cause = caught.value.cause  # type: ignore[attr-defined]
        assert isinstance(cause, StaleCheckpoint)
        assert cause.code == "stale_checkpoint"

        wrong = ControlClient(url, token="nope", limit=1, limit_per_host=1)
        async with wrong:
            with pytest.raises(Unauthorized):
                await wrong.status()

    async with http.put(f"{url}/episodes/r2", json={"s": 2}) as resp:
        assert resp.status == 200


async def test_placement_naming_and_get_if_exists(start: Start, namespace: str) -> None:
    node = current_node_id()
    spec = spec_for("placed", "aiohttp")
    _handle, info = await start(spec, node_id=node)
    assert info["node_id"] == node
    found = get_host("environment", "placed", namespace=namespace)
    assert (await found.ready.remote())["pid"] == info["pid"]
    # get_if_exists: starting it again finds the running host, same process and port.
    _, again = await start(spec)
    assert (again["pid"], again["port"]) == (info["pid"], info["port"])
    with pytest.raises(ValueError, match="namespace"):
        start_host(spec, namespace="")


async def test_a_host_that_cannot_bind_dies_at_creation(start: Start) -> None:
    from ray.exceptions import RayActorError

    _, info = await start(spec_for("first", "aiohttp"))
    taken = ServerSpec(
        kind="environment",
        name="second",
        factory=FACTORIES["aiohttp"],
        port=info["port"],
        settings=spec_for("x", "aiohttp").settings,
    )
    # __init__ binds synchronously, so the error is the actor's cause of death.
    with pytest.raises(RayActorError, match="Address already in use"):
        await start(taken)


@pytest.mark.parametrize("flavour", ["aiohttp", "fastapi"])
async def test_graceful_stop_drains_in_flight_data_calls(
    start: Start, http: aiohttp.ClientSession, flavour: str
) -> None:
    handle, info = await start(spec_for(f"draining-{flavour}", flavour))
    slow = asyncio.ensure_future(http.get(f"{info['url']}/slow", params={"s": "0.5"}))
    await asyncio.sleep(0.2)  # the request is being handled
    stopped = await handle.stop.remote()
    assert stopped == {"stopped": True, "idempotent": False}
    async with await slow as resp:
        assert resp.status == 200
        assert (await resp.json()) == {"slept": True}
    with pytest.raises(aiohttp.ClientConnectionError):
        async with http.get(f"{info['url']}/echo"):
            pass
    assert (await handle.stop.remote())["idempotent"] is True


async def test_killed_host_is_detected_and_a_fresh_host_restores_once(
    start: Start, http: aiohttp.ClientSession, tmp_path: Path, namespace: str
) -> None:
    import ray

    spec = spec_for("phoenix", "aiohttp")
    first, info = await start(spec)
    state = {"obs": [1, 2.5, "x"], "nested": {"b": 1, "a": None}}
    async with http.put(f"{info['url']}/episodes/r1", json=state) as resp:
        assert resp.status == 200
    ckpt = str(tmp_path / "ckpt")
    assert (await first.prepare.remote(body("c1")))["phase"] == "prepared"
    committed = await first.commit.remote(body("c1", checkpoint_dir=ckpt))
    assert committed["episode_ids"] == ["r1"]
    await first.resume.remote(body("c1"))

    ray.kill(first, no_restart=True)
    await until_dead(first)

    # The name is free again once Ray has seen the death.
    for _ in range(100):
        try:
            get_host("environment", "phoenix", namespace=namespace)
        except ValueError:
            break
        await asyncio.sleep(0.05)
    second, info2 = await start(spec)
    assert info2["pid"] != info["pid"]
    restore = body("c2", checkpoint_dir=ckpt, episode_ids=[{"rollout_id": "r1", "attempt": 0}])
    restored = await second.restore.remote(restore)
    assert restored["restored"] == ["r1-a1"]
    assert restored["source_checkpoint_id"] == "c1"
    async with http.get(f"{info2['url']}/episodes") as resp:
        assert await resp.json() == {"r1-a1": state}
    # A retried restore is answered again; another restore is refused.
    assert await second.restore.remote(restore) == restored
    with pytest.raises(CheckpointConflict):
        await second.restore.remote({**restore, "checkpoint_id": "c3"})
    assert (await second.resume.remote(body("c2")))["phase"] == "idle"
    # After its one restore it serves; restore stays refused for good.
    async with http.put(f"{info2['url']}/episodes/r1-a1", json={"more": 1}) as resp:
        assert resp.status == 200
    with pytest.raises(InvalidPhase, match="fresh process"):
        await second.restore.remote({**restore, "checkpoint_id": "c4"})
