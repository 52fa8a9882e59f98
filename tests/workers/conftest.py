"""Multi-worker hosts run in the test's loop (the real `ParticipantHost` class,
off Ray: its workers are real processes either way), serving the reference
counter server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from ray_ckpt.gym_server.spec import ServerSpec
from ray_ckpt.hosting.host import ParticipantHost

TOKEN = "workers-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

StartHost = Callable[..., Awaitable[ParticipantHost]]


def spec(workers: int, *, spreading: str = "rollout", **options: Any) -> ServerSpec:
    stateless = bool(options.pop("stateless", False))
    return ServerSpec(
        kind="resources",
        name="counter",
        factory="participants.servers.counter:counter_server",
        options=options,
        settings={"enabled": True, "control_auth_token": TOKEN, "lease_grace_seconds": 30.0},
        workers=workers,
        spreading=spreading,
        stateless=stateless,
    )


def body(cid: str, wait_s: float = 10.0, **extra: Any) -> dict[str, Any]:
    return {"checkpoint_id": cid, "deadline_ts": time.time() + wait_s, **extra}


def kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


@pytest.fixture
async def start_host() -> AsyncIterator[StartHost]:
    hosts: list[ParticipantHost] = []

    async def start(workers: int, **kw: Any) -> ParticipantHost:
        host = ParticipantHost(spec(workers, **kw))
        hosts.append(host)
        await host._ready()
        return host

    yield start
    for host in reversed(hosts):
        await host.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # A connection per request: the shared port spreads connections.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        yield session


async def step(
    http: aiohttp.ClientSession, url: str, key: str, hold_s: float = 0.0
) -> tuple[int, dict[str, Any]]:
    async with http.post(f"{url}/ng-rollout/{key}/step", json={"hold_s": hold_s}) as resp:
        return resp.status, await resp.json()


async def step_open(
    http: aiohttp.ClientSession, url: str, key: str, timeout_s: float = 5.0
) -> tuple[int, dict[str, Any]]:
    """A step retried while `admission_closed`, as callers do: a resume
    reopens the workers right after it answers."""
    async with asyncio.timeout(timeout_s):
        while True:
            status, reply = await step(http, url, key)
            if status != 409 or reply["error"]["code"] != "admission_closed":
                return status, reply
            await asyncio.sleep(0.02)
