"""Discovery refuses a server run by several unmanaged worker processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

import aiohttp
import pytest
from aiohttp import web

from coordination.engine.membership import discover_candidates
from coordination.engine.order import Member
from coordination.reach.hosts import HttpHost
from ray_ckpt.control.client import ControlClient
from ray_ckpt.control.routes import CHECKPOINT_ROUTE_PREFIX
from ray_ckpt.errors import CoordinationFailed
from ray_ckpt.gym_server.serving import bind_socket, serve_app, socket_address
from ray_ckpt.hosting.host import ParticipantHost
from ray_ckpt.workers.detect import UnmanagedWorkers, refuse_unmanaged_workers
from tests.servers import SETTINGS_ENV
from tests.workers.conftest import AUTH, TOKEN, StartHost

SETTINGS = f'{{"enabled": true, "control_auth_token": "{TOKEN}"}}'


class Unmanaged(NamedTuple):
    url: str
    supervisor: int  # holds the shared socket, never accepts on it
    workers: list[int]


@pytest.fixture
async def unmanaged() -> AsyncIterator[Callable[..., Unmanaged]]:
    procs: list[subprocess.Popen[str]] = []

    def start(workers: int, framework: str = "aiohttp") -> Unmanaged:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.workers.unmanaged", str(workers), framework],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, SETTINGS_ENV: SETTINGS},
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("URL "), line
        _, url, pids = line.split()
        return Unmanaged(url, proc.pid, sorted(int(p) for p in pids.split(",")))

    yield start
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)


def http_host(url: str) -> HttpHost:
    client = ControlClient(url, token=TOKEN, limit=4, limit_per_host=4)
    return HttpHost(Member(kind="environment", name="srv"), client)


@pytest.mark.parametrize("framework", ["aiohttp", "fastapi"])
async def test_status_names_the_processes_that_accept_on_the_port(
    unmanaged: Callable[..., Unmanaged], framework: str
) -> None:
    two = await asyncio.to_thread(unmanaged, 2, framework)
    one = await asyncio.to_thread(unmanaged, 1, framework)
    async with aiohttp.ClientSession(headers=AUTH) as session:
        for server in (two, one):
            url = f"{server.url}{CHECKPOINT_ROUTE_PREFIX}/status"
            async with session.get(url, params={"processes": "1"}) as resp:
                assert resp.status == 200
                reply = await resp.json()
            # The workers, never the supervisor that only holds the socket.
            assert reply["accepting_processes"] == server.workers
            assert server.supervisor not in reply["accepting_processes"]
            async with session.get(url) as resp:
                assert "accepting_processes" not in await resp.json()  # only when asked


@pytest.mark.parametrize("framework", ["aiohttp", "fastapi"])
async def test_discovery_refuses_several_unmanaged_workers_and_takes_managed_ones(
    unmanaged: Callable[..., Unmanaged], start_host: StartHost, framework: str
) -> None:
    two = await asyncio.to_thread(unmanaged, 2, framework)
    bad = http_host(two.url)
    single = http_host((await asyncio.to_thread(unmanaged, 1, framework)).url)
    # Every time, not by chance: the server names its accepting processes.
    for _ in range(3):
        with pytest.raises(CoordinationFailed) as info:
            await discover_candidates([bad], 5.0)
        failure = info.value.failures["environment/srv"]
        assert failure["code"] == "invalid_request"
        assert "several worker processes" in failure["detail"]
        assert all(str(pid) in failure["detail"] for pid in two.workers)
    # One process: taken.  A managed multi-worker server: taken (one host answers).
    found, _ = await discover_candidates([single], 5.0)
    assert found == [single]
    managed: ParticipantHost = await start_host(2)
    client = ControlClient(managed.url, token=TOKEN, limit=4, limit_per_host=4)
    await refuse_unmanaged_workers(client, await client.status())
    with pytest.raises(UnmanagedWorkers):
        await refuse_unmanaged_workers(bad.client, await bad.client.status())
    for host in (bad, single):
        await host.client.aclose()
    await client.aclose()


async def test_where_the_server_cannot_tell_probes_decide() -> None:
    """A server without `accepting_processes` (not Linux, an older ray-ckpt):
    fresh-connection probes, and two processes named is the refusal."""
    names: list[str] = []
    asked: list[str] = []

    async def status(request: web.Request) -> web.Response:
        asked.append(request.query_string)
        return web.json_response({"phase": "idle", "process": names[(len(asked) - 1) % len(names)]})

    app = web.Application()
    app.router.add_get(f"{CHECKPOINT_ROUTE_PREFIX}/status", status)
    sock = bind_socket("127.0.0.1", 0)
    serving = await serve_app(app, sock, drain_s=0.5)
    host, port = socket_address(sock)
    client = ControlClient(f"http://{host}:{port}", token=TOKEN, limit=4, limit_per_host=4)
    try:
        names[:] = ["1-a"]
        await refuse_unmanaged_workers(client, await client.status(), probes=5)
        assert len(asked) == 1 + 1 + 5  # the first status, the asking one, every probe
        assert asked[1] == "processes=1"
        names[:] = ["1-a"] * 4 + ["2-b"]  # the fifth call lands elsewhere
        asked.clear()
        with pytest.raises(UnmanagedWorkers, match="2-b"):
            await refuse_unmanaged_workers(client, await client.status(), probes=5)
        assert len(asked) == 5  # stops at the first second process
    finally:
        await client.aclose()
        await serving.stop()
        sock.close()
