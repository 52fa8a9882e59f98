"""The control client over loopback: its reserved pool, typed errors, timeouts."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from pydantic import SecretStr

from ray_ckpt.clock import ManualClock
from ray_ckpt.control.client import ControlClient, data_session
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.control.routes import CHECKPOINT_ROUTE_PREFIX, control_app, install_control_routes
from ray_ckpt.control.wire import CheckpointRequest, decode_request
from ray_ckpt.errors import (
    CheckpointConflict,
    CheckpointError,
    CoordinationFailed,
    DeadlineExceeded,
    InvalidCheckpointState,
    InvalidRequest,
    NotFound,
    ParticipantUnavailable,
    StaleCheckpoint,
    Unauthorized,
)
from ray_ckpt.settings import CheckpointSettings
from tests.unit.conftest import Serve
from tests.unit.fakes import FakeParticipant, MemoryStore
from tests.unit.helpers import body

TOKEN = "pool-token"


class Target:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.error: Exception | None = None
        self.gate: asyncio.Event | None = None

    async def handle(self, op: str, body: bytes | dict[str, Any]) -> dict[str, Any]:
        req = decode_request(op, body)
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        self.calls.append(op)
        return {"op": op, "checkpoint_id": req.checkpoint_id}

    def status(self) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        return {"phase": "idle"}


# --- the reserved pool --------------------------------------------------------------


async def test_control_call_answered_while_data_pool_is_saturated(serve: Serve) -> None:
    release = asyncio.Event()
    entered: list[str] = []
    parked = asyncio.Event()

    async def park(request: web.Request) -> web.Response:
        entered.append(request.match_info["n"])
        parked.set()
        await release.wait()
        return web.Response(text="done")

    target = Target()
    app = web.Application()
    app.router.add_get("/data/{n}", park)
    install_control_routes(app, target, token=TOKEN)
    base = await serve(app)  # data and control: the same host, so the same per-host limit

    async with (
        data_session(limit=10, limit_per_host=1) as data,
        ControlClient(base, token=TOKEN, limit=4, limit_per_host=1) as control,
    ):

        async def fetch(n: int) -> str:
            async with data.get(f"{base}/data/{n}") as r:
                return await r.text()

        first = asyncio.create_task(fetch(1))
        second = asyncio.create_task(fetch(2))
        try:
            await asyncio.wait_for(parked.wait(), 5)
            # The data pool really is exhausted: a control call through it would wait.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(data.get(f"{base}{CHECKPOINT_ROUTE_PREFIX}/status"), 0.3)
            status = await asyncio.wait_for(control.status(), 5)
            reply = await asyncio.wait_for(control.call("prepare", body("ckpt-1")), 5)
            assert status == {"phase": "idle"}
            assert reply == {"op": "prepare", "checkpoint_id": "ckpt-1"}
            assert entered == ["1"]  # the next data call is still waiting for its connection
            assert not second.done()
        finally:
            release.set()
            results = await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert list(results) == ["done", "done"]
        assert entered == ["1", "2"]


async def test_pools_take_their_limits() -> None:
    settings = CheckpointSettings(
        enabled=True,
        control_auth_token=SecretStr(TOKEN),
        global_aiohttp_control_connector_limit=7,
        global_aiohttp_control_connector_limit_per_host=3,
    )
    client = ControlClient.from_settings("http://h:1/", settings)
    assert client.base_url == "http://h:1"
    assert TOKEN not in repr(client)

    async with client:
        connector = client._open().connector
        assert connector is not None
        assert (connector.limit, connector.limit_per_host) == (7, 3)


# --- replies and errors -----------------------------------------------------------


async def test_replies_and_typed_errors(serve: Serve) -> None:
    target = Target()
    base = await serve(control_app(target, token=TOKEN))
    async with ControlClient(base, token=TOKEN, limit=2, limit_per_host=1) as c:
        req = CheckpointRequest(checkpoint_id="ckpt-2", deadline_ts=time.time() + 30)
        assert await c.call("resume", req) == {"op": "resume", "checkpoint_id": "ckpt-2"}
        for error in (
            StaleCheckpoint("old"),
            CheckpointConflict("other"),
            InvalidCheckpointState("corrupt"),
        ):
            target.error = error
            with pytest.raises(type(error)) as info:
                await c.call("prepare", body("ckpt-1"))
            assert info.value.detail == error.detail
        target.error = CoordinationFailed("x", operation="commit", failures={"e/1": {"c": 1}})
        with pytest.raises(CoordinationFailed) as failed:
            await c.call("commit", {**body("ckpt-1"), "checkpoint_dir": "/d"})
        assert (failed.value.operation, failed.value.failures) == ("commit", {"e/1": {"c": 1}})
        target.error = RuntimeError("bug")
        with pytest.raises(ParticipantUnavailable, match="internal"):
            await c.status()
        with pytest.raises(InvalidRequest, match="unknown control operation"):
            await c.call("explode", body("ckpt-1"))
    assert target.calls == ["resume"]


async def test_wrong_token_and_server_without_routes(serve: Serve) -> None:
    base = await serve(control_app(Target(), token=TOKEN))
    async with ControlClient(base, token="wrong", limit=2, limit_per_host=1) as c:
        with pytest.raises(Unauthorized):
            await c.status()
    plain = await serve(web.Application())
    async with ControlClient(plain, token=TOKEN, limit=2, limit_per_host=1) as c:
        with pytest.raises(NotFound):
            await c.status()


async def test_unreachable_participant() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connection refused
        async with ControlClient(
            f"http://127.0.0.1:{port}", token=TOKEN, limit=2, limit_per_host=1
        ) as c:
            with pytest.raises(ParticipantUnavailable) as info:
                await c.call("prepare", body("ckpt-1"))
    assert info.value.retryable


async def test_timeout_follows_the_calls_deadline(serve: Serve) -> None:
    target = Target()
    target.gate = asyncio.Event()  # never answers until the test ends
    base = await serve(control_app(target, token=TOKEN))
    clock = ManualClock(start=time.time())
    async with ControlClient(
        base, token=TOKEN, limit=2, limit_per_host=1, grace_s=0.1, timeout_s=60, clock=clock
    ) as c:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await c.call("prepare", {**body("ckpt-1"), "deadline_ts": clock.now() + 0.2})
        assert time.monotonic() - started < 2.0
        # A deadline already behind us leaves only the grace.
        clock.advance(3600)
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await c.call("prepare", {**body("ckpt-1"), "deadline_ts": clock.now() - 10})
        assert time.monotonic() - started < 1.0
    target.gate.set()


async def test_closed_client_refuses() -> None:
    c = ControlClient("http://127.0.0.1:9", token=TOKEN, limit=1, limit_per_host=1)
    await c.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await c.status()
    with pytest.raises(ValueError, match="token"):
        ControlClient("http://x", token="", limit=1, limit_per_host=1)


# --- the real engine, end to end over HTTP -----------------------------------


@pytest.fixture
async def engine() -> AsyncIterator[tuple[ParticipantEngine, FakeParticipant]]:
    participant = FakeParticipant()
    settings = CheckpointSettings(enabled=True, control_auth_token=SecretStr(TOKEN))
    ctl = ParticipantEngine(
        participant, instance="env-0", settings=settings, store=MemoryStore()
    )
    yield ctl, participant
    await ctl.aclose()


async def test_checkpoint_cycle_through_the_client(
    serve: Serve, engine: tuple[ParticipantEngine, FakeParticipant]
) -> None:
    ctl, participant = engine
    participant.start("r1", at_boundary=True, state={"step": 3})
    base = await serve(control_app(ctl, token=TOKEN))
    async with ControlClient(base, token=TOKEN, limit=2, limit_per_host=1) as c:
        prepared = await c.call("prepare", body("ckpt-1"))
        assert prepared["phase"] == "prepared"
        assert not participant.admission_open
        commit = {**body("ckpt-1"), "checkpoint_dir": "/ck", "episode_ids": [{"rollout_id": "r1"}]}
        committed = await c.call("commit", commit)
        assert (committed["phase"], committed["episode_ids"]) == ("committed", ["r1"])
        assert await c.call("commit", commit) == committed  # a retry answers the same
        assert (await c.status())["phase"] == "committed"
        assert await c.call("resume", body("ckpt-1")) == {"phase": "idle", "idempotent": False}
        assert participant.admission_open
        with pytest.raises(StaleCheckpoint):
            await c.call("prepare", body("ckpt-1"))
        assert (await c.call("prepare", body("ckpt-2")))["phase"] == "prepared"
        with pytest.raises(CheckpointConflict):
            await c.call("prepare", body("ckpt-3"))
        with pytest.raises(DeadlineExceeded):
            await c.call("renew", body("ckpt-2", deadline=-1))
        await c.call("resume", body("ckpt-2"))
        restore = {**body("ckpt-4"), "checkpoint_dir": "/none", "episode_ids": []}
        with pytest.raises(CheckpointError) as refused:
            await c.call("restore", restore)
        assert refused.value.code == "invalid_phase"  # this process served r1: not fresh
    assert ctl.status()["phase"] == "idle"
