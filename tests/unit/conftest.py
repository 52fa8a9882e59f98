"""Shared unit-test fixtures: real aiohttp servers on loopback; and no Ray.

Unit tests run without Ray (the pure core, in-process participants, loopback
servers): here that is enforced, not only said.  `ray.init` fails in every
unit test, and so do the shared cluster's fixtures (`ray_session`,
`namespace`), which a whole run may have started already for tests/ray."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

Serve = Callable[[web.Application], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Start apps on 127.0.0.1 (port 0); yields a starter returning the base URL."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    yield start
    for runner in reversed(runners):
        await runner.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


class RayInUnitTest(RuntimeError):
    """A unit test tried to start or use Ray."""


_NO_RAY = "unit tests run without Ray: move this test under tests/ray (or tests/e2e)"


@pytest.fixture(autouse=True)
def _no_ray_init(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise RayInUnitTest(_NO_RAY)

    monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture
def ray_session() -> str:
    raise RayInUnitTest(_NO_RAY)


@pytest.fixture
def namespace() -> str:
    raise RayInUnitTest(_NO_RAY)


def pytest_addoption(parser: pytest.Parser) -> None:
    # tests/partitions/conftest.py adds the same option (its random partition
    # runs): whichever conftest loads first adds it.
    with contextlib.suppress(ValueError):
        parser.addoption("--seeds", type=int, default=None, help="random sequence seeds 0..N-1")
