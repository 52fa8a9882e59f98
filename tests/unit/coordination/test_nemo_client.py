"""Our client and coordinator against NeMo Gym-shaped HTTP replies (real aiohttp, loopback).

NeMo Gym's control plane answers a malformed body with FastAPI's 422
`{"detail": [...]}`, a server without the control routes answers 404 on
status, and every participant says its kind in `status.kind`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from coordination.engine.coordinator_core import CoordinatorCore
from coordination.engine.journal import Journal
from coordination.engine.membership import KindMismatch
from coordination.engine.order import Member
from coordination.reach.hosts import HttpHost
from ray_ckpt.control.client import ControlClient
from ray_ckpt.control.routes import CHECKPOINT_ROUTE_PREFIX
from ray_ckpt.errors import (
    CoordinationFailed,
    InvalidCheckpointState,
    InvalidRequest,
)
from tests.unit.conftest import Serve
from tests.unit.coordination.coord_fleet import FAST

TOKEN = "tok"
FASTAPI_422 = {
    "detail": [
        {
            "type": "extra_forbidden",
            "loc": ["body", "unknown"],
            "msg": "Extra inputs are not permitted",
            "input": 1,
        }
    ]
}


def app(kind: str | None, *, prepare: tuple[int, Any] = (422, FASTAPI_422)) -> web.Application:
    """A control plane whose status says `kind` (None: no control routes at all)."""
    a = web.Application()
    if kind is None:
        return a  # every path 404s, as on a server without the routes

    async def status(_: web.Request) -> web.Response:
        return web.json_response(
            {"kind": kind, "instance": "x", "phase": "idle", "report": {"blockers": []}}
        )

    async def post(_: web.Request) -> web.Response:
        code, body = prepare
        return web.json_response(body, status=code)

    a.router.add_get(f"{CHECKPOINT_ROUTE_PREFIX}/status", status)
    a.router.add_post(f"{CHECKPOINT_ROUTE_PREFIX}/prepare", post)
    return a


def client(url: str) -> ControlClient:
    return ControlClient(url, token=TOKEN, limit=2, limit_per_host=2)


@pytest.fixture
async def core() -> AsyncIterator[CoordinatorCore]:
    c = CoordinatorCore(journal=Journal(None), timeouts=FAST)
    yield c
    await c.aclose()


async def test_a_fastapi_422_is_a_typed_invalid_request_carrying_its_detail(serve: Serve) -> None:
    url = await serve(app("environment"))
    async with client(url) as c:
        with pytest.raises(InvalidRequest, match=r"extra_forbidden at body\.unknown") as info:
            await c.call("prepare", {"checkpoint_id": "c1", "deadline_ts": time.time() + 5})
    assert info.value.validation == FASTAPI_422["detail"]
    assert info.value.code == "invalid_request"


async def test_our_own_422_envelope_keeps_its_code(serve: Serve) -> None:
    body = {"error": {"code": "invalid_checkpoint_state", "detail": "digest mismatch"}}
    url = await serve(app("environment", prepare=(422, body)))
    async with client(url) as c:
        with pytest.raises(InvalidCheckpointState, match="digest"):
            await c.call("prepare", {"checkpoint_id": "c1", "deadline_ts": time.time() + 5})


async def test_discovery_skips_a_404_server_and_registers_the_participants(
    serve: Serve, core: CoordinatorCore
) -> None:
    env, judge = await serve(app("environment")), await serve(app(None))
    hosts = [
        HttpHost(Member("environment", "env"), client(env)),
        HttpHost(Member("model", "judge"), client(judge)),
    ]
    registered, skipped = await core.discover_http(hosts)
    assert (registered, skipped) == (["environment/env"], ["model/judge"])
    assert sorted(core.hosts) == ["environment/env"]


async def test_discovery_fails_naming_a_kind_mismatch_and_registers_none(
    serve: Serve, core: CoordinatorCore
) -> None:
    env, model = await serve(app("environment")), await serve(app("environment"))
    hosts = [
        HttpHost(Member("environment", "env"), client(env)),
        HttpHost(Member("model", "policy"), client(model)),
    ]
    with pytest.raises(CoordinationFailed) as info:
        await core.discover_http(hosts)
    assert set(info.value.failures) == {"model/policy"}
    assert "reports kind 'environment'" in info.value.failures["model/policy"]["detail"]
    assert core.hosts == {}


async def test_registration_checks_the_reported_kind(serve: Serve, core: CoordinatorCore) -> None:
    url = await serve(app("agent"))
    wrong = HttpHost(Member("resources", "r"), client(url))
    with pytest.raises(KindMismatch, match="register it as agent/r"):
        await core.register_checked(wrong)
    await wrong.aclose()
    assert core.hosts == {}
    right = HttpHost(Member("agent", "r"), client(url))
    assert await core.register_checked(right) is None
    assert sorted(core.hosts) == ["agent/r"]


async def test_registration_refuses_a_server_that_is_not_a_participant(
    serve: Serve, core: CoordinatorCore
) -> None:
    url = await serve(app(None))
    host = HttpHost(Member("agent", "r"), client(url))
    with pytest.raises(InvalidRequest, match="not a participant"):
        await core.register_checked(host)
    await host.aclose()
    assert core.hosts == {}
