"""Fixtures: NeMo Gym-shaped participants on loopback, one aiohttp app each;
`checked_http`, a client session that validates every control reply it
receives against the published JSON Schema (`ray-ckpt schema`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import jsonschema
import pytest
from aiohttp import web

from ray_ckpt.control.routes import CHECKPOINT_ROUTE_PREFIX
from ray_ckpt.control.schema import ROUTES, reply_schema
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


def _validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


# Per route: the 200 reply's validator and the rejection's.
REPLY_VALIDATORS = {
    name: (_validator(reply_schema(name)), _validator(reply_schema(name, error=True)))
    for name in ROUTES
}
ERROR_VALIDATOR = REPLY_VALIDATORS["status"][1]


@dataclass
class ReplyCheck:
    """Every control reply seen, validated: (method, path, status) of each."""

    seen: list[tuple[str, str, int]] = field(default_factory=list)

    def check(self, method: str, path: str, status: int, body: bytes, content_type: str) -> None:
        if status == 404 and content_type != "application/json":
            # A server without our routes (NeMo Gym's discovery: "not a
            # participant"); ours answers every path under the prefix in JSON.
            return
        route = path.removeprefix(CHECKPOINT_ROUTE_PREFIX + "/")
        reply = json.loads(body)
        if status == 200:
            ok, _ = REPLY_VALIDATORS[route]
            ok.validate(reply)
        else:
            # An unknown route or method is rejected with the same envelope.
            _, error = REPLY_VALIDATORS.get(route, (None, ERROR_VALIDATOR))
            error.validate(reply)
        self.seen.append((method, path, status))


@pytest.fixture
async def checked_http() -> AsyncIterator[aiohttp.ClientSession]:
    """A session whose every reply under the control prefix must match the
    schema of its route (a 200) or the error envelope (any rejection); a
    mismatch raises `jsonschema.ValidationError` in the call that got it.
    The test fails too if it received no control reply at all."""
    check = ReplyCheck()

    async def validate(
        request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
    ) -> aiohttp.ClientResponse:
        resp = await handler(request)
        path = request.url.path
        if path.startswith(CHECKPOINT_ROUTE_PREFIX + "/"):
            # Read here: the body is kept, so the caller's resp.json() still works.
            body = await resp.read()
            check.check(request.method, path, resp.status, body, resp.content_type)
        return resp

    async with aiohttp.ClientSession(middlewares=(validate,)) as session:
        yield session
    assert check.seen, "no control reply was received, so none was validated"
