"""Fixtures: NeMo Gym-shaped participants on loopback, one aiohttp app each."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web

from tests.conformance.nemo_participant import NemoParticipant, make_app

TOKEN = "conformance-token"
KINDS = ("environment", "model", "agent", "resources")


@dataclass
class Served:
    participant: NemoParticipant
    url: str
    runner: web.AppRunner

    async def stop(self) -> None:
        await self.runner.cleanup()


Serve = Callable[..., Awaitable[Served]]


@pytest.fixture
async def serve_nemo() -> AsyncIterator[Serve]:
    """Start a NeMo Gym-shaped participant on 127.0.0.1 (a fresh "process" each call)."""
    served: list[Served] = []

    async def start(
        kind: str, instance: str | None = None, *, lease_grace_seconds: float = 600.0
    ) -> Served:
        p = NemoParticipant(
            kind, instance or f"ng-{kind}", TOKEN, lease_grace_seconds=lease_grace_seconds
        )
        runner = web.AppRunner(make_app(p))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        served.append(Served(p, f"http://{host}:{port}", runner))
        return served[-1]

    yield start
    for s in reversed(served):
        await s.stop()


@pytest.fixture
async def nemo_fleet(serve_nemo: Serve) -> dict[str, Served]:
    """One NeMo Gym-shaped participant per kind."""
    return {kind: await serve_nemo(kind) for kind in KINDS}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
