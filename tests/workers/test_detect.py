"""Discovery refuses a server run by several unmanaged worker processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable

import pytest

from coordination.hosts import HttpHost
from coordination.membership import discover_candidates
from coordination.order import Member
from ray_ckpt.control.client import ControlClient
from ray_ckpt.errors import CoordinationFailed
from ray_ckpt.hosting.host import ParticipantHost
from ray_ckpt.workers.detect import UnmanagedWorkers, refuse_unmanaged_workers
from tests.servers import SETTINGS_ENV
from tests.workers.conftest import TOKEN, StartHost

SETTINGS = f'{{"enabled": true, "control_auth_token": "{TOKEN}"}}'


@pytest.fixture
async def unmanaged() -> AsyncIterator[Callable[[int], str]]:
    procs: list[subprocess.Popen[str]] = []

    def start(workers: int) -> str:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.workers.unmanaged", str(workers)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, SETTINGS_ENV: SETTINGS},
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("URL "), line
        return line.split()[1]

    yield start
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)


def http_host(url: str) -> HttpHost:
    client = ControlClient(url, token=TOKEN, limit=4, limit_per_host=4)
    return HttpHost(Member(kind="environment", name="srv"), client)


async def test_discovery_refuses_several_unmanaged_workers_and_takes_managed_ones(
    unmanaged: Callable[[int], str], start_host: StartHost
) -> None:
    bad = http_host(await asyncio.to_thread(unmanaged, 2))
    single = http_host(await asyncio.to_thread(unmanaged, 1))
    with pytest.raises(CoordinationFailed) as info:
        await discover_candidates([bad], 5.0)
    failure = info.value.failures["environment/srv"]
    assert failure["code"] == "invalid_request"
    assert "several worker processes" in failure["detail"]
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
