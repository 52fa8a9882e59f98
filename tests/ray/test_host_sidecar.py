"""Sidecar mode: a Gym server in its own process, driven through a SidecarHost actor."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from pydantic import SecretStr

from ray_ckpt.control.client import ControlClient
from ray_ckpt.errors import StaleCheckpoint
from ray_ckpt.gym_server.serving import bind_socket, serve_app, socket_address
from ray_ckpt.gym_server.spec import ServerSpec, settings_dict
from ray_ckpt.hosting.host import start_host, stop_host
from ray_ckpt.hosting.sidecar import wrap_asgi_sidecar
from ray_ckpt.settings import CheckpointSettings
from tests.servers import SETTINGS_ENV, fastapi_server

pytestmark = pytest.mark.ray

TOKEN = "sidecar-test-token"


def settings(grace: float) -> CheckpointSettings:
    return CheckpointSettings(
        enabled=True, control_auth_token=SecretStr(TOKEN), lease_grace_seconds=grace
    )


def body(cid: str, ahead: float = 20.0, **extra: Any) -> dict[str, Any]:
    return {"checkpoint_id": cid, "deadline_ts": time.time() + ahead, **extra}


def control(url: str) -> ControlClient:
    return ControlClient(url, token=TOKEN, limit=4, limit_per_host=2)


async def wait_phase(client: ControlClient, phase: str, within_s: float) -> float:
    """Poll status until `phase`; returns how long it took."""
    start = time.monotonic()
    while True:
        if (await client.status())["phase"] == phase:
            return time.monotonic() - start
        if time.monotonic() - start > within_s:
            raise AssertionError(f"not {phase} after {within_s}s: {await client.status()}")
        await asyncio.sleep(0.1)


@pytest.fixture
async def sidecar_process() -> AsyncIterator[str]:
    """The aiohttp test server with the sidecar integration, as a real subprocess.

    Its lease grace is 1 s, so a dead host is noticed within seconds.
    """
    env = {**os.environ, SETTINGS_ENV: json.dumps(settings_dict(settings(1.0)))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.servers",
        "--name",
        "side",
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.startswith(b"URL "), line
        yield line.decode().split()[1]
    finally:
        if proc.returncode is None:
            proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_sidecar_host_forwards_and_keeps_the_lease_until_it_dies(
    sidecar_process: str, namespace: str
) -> None:
    import ray

    url = sidecar_process
    spec = ServerSpec(
        kind="environment", name="side", url=url, settings=settings_dict(settings(600.0))
    )
    host = start_host(spec, namespace=namespace)
    try:
        info = await host.ready.remote()
        assert info["mode"] == "sidecar"
        assert info["url"] == url
        assert info["pid"] != os.getpid()
        async with aiohttp.ClientSession() as http, control(url) as direct:
            async with http.put(f"{url}/episodes/r1", json={"s": 1}) as resp:
                assert resp.status == 200
            # Deadline 1 s ahead + the server's 1 s grace: it would lapse in ~2 s.
            assert (await host.prepare.remote(body("c1", ahead=1.0)))["phase"] == "prepared"
            assert (await direct.status())["checkpoint_id"] == "c1"
            await asyncio.sleep(3.0)
            # The host kept renewing: still prepared, and the lease is ahead of now.
            status = await host.status.remote()
            assert status["phase"] == "prepared"
            assert status["lease_expires_at"] > time.time()
            async with http.put(f"{url}/episodes/r2", json={"s": 2}) as resp:
                assert resp.status == 409

            ray.kill(host, no_restart=True)
            took = await wait_phase(direct, "idle", within_s=8.0)
            assert took < 4.0
            # It resumed by itself: the checkpoint is fenced, data flows again.
            with pytest.raises(StaleCheckpoint):
                await direct.call("commit", body("c1", checkpoint_dir="/tmp/never"))
            async with http.put(f"{url}/episodes/r2", json={"s": 2}) as resp:
                assert resp.status == 200
    finally:
        await stop_host(host, timeout_s=5)


async def test_sidecar_host_replies_equal_the_server_and_errors_stay_typed(
    sidecar_process: str, namespace: str
) -> None:
    url = sidecar_process
    spec = ServerSpec(
        kind="environment", name="side", url=url, settings=settings_dict(settings(600.0))
    )
    host = start_host(spec, namespace=namespace)
    try:
        async with control(url) as direct:
            prepared = await host.prepare.remote(body("c1"))
            assert await direct.call("prepare", body("c1")) == prepared
            assert (await host.resume.remote(body("c1")))["phase"] == "idle"
            with pytest.raises(StaleCheckpoint) as caught:
                await host.prepare.remote(body("c1"))
            assert isinstance(caught.value.cause, StaleCheckpoint)  # type: ignore[attr-defined]
            assert (await direct.status())["phase"] == "idle"
        assert (await host.stop.remote())["stopped"] is True
    finally:
        await stop_host(host, timeout_s=5)


async def test_asgi_sidecar_lease_watcher_runs_without_lifespan() -> None:
    """In-process: the ASGI integration starts its lease watcher on the first call."""
    server = fastapi_server(name="asgi-side", settings=settings(0.3))
    app, engine = wrap_asgi_sidecar(
        server.app(), server.participant, settings(0.3), instance="asgi-side"
    )
    assert engine is not None
    sock = bind_socket("127.0.0.1", 0)
    host, port = socket_address(sock)
    serving = await serve_app(app, sock, drain_s=1.0)
    try:
        async with control(f"http://{host}:{port}") as client:
            reply = await client.call("prepare", body("c1", ahead=0.2))
            assert reply["phase"] == "prepared"
            took = await wait_phase(client, "idle", within_s=5.0)
            assert took < 2.0
            with pytest.raises(StaleCheckpoint):
                await client.call("renew", body("c1"))
    finally:
        await serving.stop()
        sock.close()
        await engine.aclose()
    # Disabled: the app is returned unchanged, with no engine.
    plain = server.app()
    assert wrap_asgi_sidecar(plain, server.participant, CheckpointSettings(), instance="x") == (
        plain,
        None,
    )


async def test_a_sidecar_host_reports_the_server_s_metrics(
    sidecar_process: str, namespace: str, ray_metrics_url: str
) -> None:
    """The server runs outside Ray, so its host reports for it: each forwarded
    call by outcome, and the coordinator's lease lapsing (the server resumes
    by itself), on Ray's Prometheus endpoint."""
    from tests.ray.test_metrics_export import scrape_until, total, worker_id

    url = sidecar_process
    # The coordinator's lease held here lapses 0.5 s after the last deadline.
    spec = ServerSpec(
        kind="environment", name="side", url=url, settings=settings_dict(settings(0.5))
    )
    host = start_host(spec, namespace=namespace)
    try:
        await host.ready.remote()
        assert (await host.prepare.remote(body("m1")))["phase"] == "prepared"
        await host.resume.remote(body("m1"))
        with pytest.raises(StaleCheckpoint):
            await host.commit.remote(body("m1", checkpoint_dir="/tmp/never"))
        await host.prepare.remote(body("m2", ahead=0.5))  # then nobody calls again
        found = await scrape_until(
            ray_metrics_url,
            {worker_id(host)},
            [
                ("ray_ckpt_control_call_seconds_count", {"op": "prepare", "outcome": "ok"}, 2),
                ("ray_ckpt_control_call_seconds_count", {"op": "commit", "outcome": "failed"}),
                ("ray_ckpt_lease_expiries_total", {"kind": "environment"}),
            ],
        )
    finally:
        await stop_host(host, timeout_s=5)
    count = "ray_ckpt_control_call_seconds_count"
    assert total(found, count, op="resume", outcome="ok") == 1
    assert total(found, count, op="commit", outcome="ok") is None
    assert total(found, "ray_ckpt_lease_expiries_total") == 1
    assert total(found, "ray_ckpt_writes_in_flight") == 0
