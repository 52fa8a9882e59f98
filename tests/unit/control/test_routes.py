"""The control routes over real loopback HTTP (aiohttp) and through ASGI (FastAPI)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from fastapi import FastAPI
from pydantic import SecretStr

from ray_ckpt.control.asgi import ControlASGIMiddleware
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.control.routes import (
    CHECKPOINT_ROUTE_PREFIX,
    CONTROL_TARGET_KEY,
    control_app,
    install_control_routes,
    maybe_install_control_routes,
)
from ray_ckpt.control.wire import OPERATIONS, CheckpointRequest, decode_request
from ray_ckpt.errors import (
    CheckpointError,
    CoordinationFailed,
    InvalidCheckpointState,
    Reason,
    StaleCheckpoint,
)
from ray_ckpt.settings import CheckpointSettings
from tests.unit.conftest import Serve
from tests.unit.fakes import FakeParticipant, MemoryStore

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EP = [{"rollout_id": "r1", "attempt": 0}]
BASE = {"checkpoint_id": "ckpt-1", "deadline_ts": 2_000_000_000.0}
VALID: dict[str, dict[str, Any]] = {
    "prepare": BASE,
    "renew": BASE,
    "resume": BASE,
    "commit": {**BASE, "checkpoint_dir": "/tmp/ck", "episode_ids": EP},
    "restore": {**BASE, "checkpoint_dir": "/tmp/ck", "episode_ids": EP},
    "retire": {**BASE, "episode_ids": EP},
    "forget": {**BASE, "rollout_ids": ["r1"]},
}
BAD_BODIES = {
    "malformed": b'{"checkpoint_id": "ckpt-1", ',
    "empty": b"",
    "not_object": b"[1, 2]",
    "wrong_type": b'{"checkpoint_id": "ckpt-1", "deadline_ts": "soon"}',
    "bool_deadline": b'{"checkpoint_id": "ckpt-1", "deadline_ts": true}',
    "bad_id": b'{"checkpoint_id": "-x", "deadline_ts": 1.0}',
    "missing_field": b'{"checkpoint_id": "ckpt-1"}',
    "unknown_field": b'{"checkpoint_id": "ckpt-1", "deadline_ts": 1.0, "extra": 1}',
}
BAD_AUTH = {
    "missing": {},
    "wrong": {"Authorization": "Bearer nope"},
    "no_scheme": {"Authorization": TOKEN},
    "lower_scheme": {"Authorization": f"bearer {TOKEN}"},
    "double_space": {"Authorization": f"Bearer  {TOKEN}"},
    "longer": {"Authorization": f"Bearer {TOKEN}x"},
    "prefix_only": {"Authorization": f"Bearer {TOKEN[:-1]}"},
}


class FakeTarget:
    """Validates like the engine, records only calls that got through."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, CheckpointRequest]] = []
        self.status_calls = 0
        self.error: Exception | None = None

    async def handle(self, op: str, body: bytes | dict[str, Any]) -> dict[str, Any]:
        req = decode_request(op, body)
        if self.error is not None:
            raise self.error
        self.calls.append((op, req))
        return {"op": op, "checkpoint_id": req.checkpoint_id}

    def status(self) -> dict[str, Any]:
        self.status_calls += 1
        if self.error is not None:
            raise self.error
        return {"phase": "idle", "calls": len(self.calls)}


def url(base: str, op: str) -> str:
    return f"{base}{CHECKPOINT_ROUTE_PREFIX}/{op}"


@pytest.fixture
def target() -> FakeTarget:
    return FakeTarget()


@pytest.fixture
async def base(serve: Serve, target: FakeTarget) -> str:
    return await serve(control_app(target, token=TOKEN, max_body_bytes=4096))


async def post(
    http: aiohttp.ClientSession, where: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(where, headers=AUTH if headers is None else headers, **kwargs) as r:
        return r.status, await r.json(content_type=None)


# --- aiohttp: the happy path ----------------------------------------------------


@pytest.mark.parametrize("op", OPERATIONS)
async def test_every_operation_reaches_the_target(
    http: aiohttp.ClientSession, base: str, target: FakeTarget, op: str
) -> None:
    status, reply = await post(http, url(base, op), VALID[op])
    assert (status, reply) == (200, {"op": op, "checkpoint_id": "ckpt-1"})
    assert [(o, r.checkpoint_id) for o, r in target.calls] == [(op, "ckpt-1")]


async def test_status_answers_json(http: aiohttp.ClientSession, base: str) -> None:
    async with http.get(url(base, "status"), headers=AUTH) as r:
        assert r.status == 200
        assert r.content_type == "application/json"
        assert await r.json() == {"phase": "idle", "calls": 0}


# --- auth ---------------------------------------------------------------------------


@pytest.mark.parametrize("headers", BAD_AUTH.values(), ids=BAD_AUTH.keys())
@pytest.mark.parametrize("op", ["status", *OPERATIONS])
async def test_bad_token_is_401_and_target_untouched(
    http: aiohttp.ClientSession, base: str, target: FakeTarget, op: str, headers: dict[str, str]
) -> None:
    if op == "status":
        async with http.get(url(base, op), headers=headers) as r:
            status, reply = r.status, await r.json()
    else:
        status, reply = await post(http, url(base, op), VALID[op], headers)
    assert status == 401
    assert reply["error"]["code"] == "unauthorized"
    assert TOKEN not in reply["error"]["detail"]
    assert (target.calls, target.status_calls) == ([], 0)


async def test_auth_is_checked_before_the_body(
    http: aiohttp.ClientSession, base: str, target: FakeTarget
) -> None:
    # An oversize, malformed body without a token is refused as unauthorized.
    status, reply = await post(http, url(base, "prepare"), b"{" * 10_000, {})
    assert (status, reply["error"]["code"]) == (401, "unauthorized")
    assert target.calls == []


def test_empty_token_is_refused(target: FakeTarget) -> None:
    with pytest.raises(ValueError, match="token"):
        install_control_routes(web.Application(), target, token="")
    with pytest.raises(ValueError, match="token"):
        ControlASGIMiddleware(FastAPI(), target, token="")


def test_install_twice_is_refused(target: FakeTarget) -> None:
    app = control_app(target, token=TOKEN)
    assert app[CONTROL_TARGET_KEY] is target
    with pytest.raises(ValueError, match="already installed"):
        install_control_routes(app, target, token=TOKEN)


# --- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
async def test_bad_body_is_400(
    http: aiohttp.ClientSession, base: str, target: FakeTarget, body: bytes
) -> None:
    status, reply = await post(http, url(base, "prepare"), body)
    assert (status, reply["error"]["code"]) == (400, "invalid_request")
    assert reply["error"]["detail"]
    assert target.calls == []


async def test_oversize_body_is_413(
    http: aiohttp.ClientSession, base: str, target: FakeTarget
) -> None:
    status, reply = await post(http, url(base, "prepare"), b" " * 4097)
    assert (status, reply["error"]["code"]) == (413, "payload_too_large")
    assert target.calls == []


async def test_oversize_chunked_body_is_413(
    http: aiohttp.ClientSession, base: str, target: FakeTarget
) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b" " * 1000

    async with http.post(url(base, "prepare"), data=chunks(), headers=AUTH) as r:
        assert (r.status, (await r.json())["error"]["code"]) == (413, "payload_too_large")
    assert target.calls == []


async def test_body_at_the_limit_is_read(
    http: aiohttp.ClientSession, base: str, target: FakeTarget
) -> None:
    body = b'{"checkpoint_id": "ckpt-1", "deadline_ts": 1.0}'
    status, _ = await post(http, url(base, "prepare"), body + b" " * (4096 - len(body)))
    assert status == 200
    assert len(target.calls) == 1


async def test_own_limit_not_the_host_apps(
    http: aiohttp.ClientSession, serve: Serve, target: FakeTarget
) -> None:
    """Mounted on someone's app with a tiny client_max_size, a long scope still fits."""
    app = web.Application(client_max_size=1024)

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hi")

    app.router.add_get("/hello", hello)
    install_control_routes(app, target, token=TOKEN)
    base = await serve(app)
    episodes = [{"rollout_id": f"r{i}", "attempt": 0} for i in range(40_000)]
    body = {**VALID["commit"], "episode_ids": episodes}
    status, _ = await post(http, url(base, "commit"), body)
    assert status == 200
    commit = target.calls[0][1]
    assert len(getattr(commit, "episode_ids", [])) == 40_000
    async with http.get(f"{base}/hello") as r:
        assert (r.status, await r.text()) == (200, "hi")


async def test_unknown_operation_and_wrong_method(http: aiohttp.ClientSession, base: str) -> None:
    async with http.post(url(base, "explode"), headers=AUTH, json=BASE) as r:
        assert r.status == 404
    async with http.get(url(base, "prepare"), headers=AUTH) as r:
        assert r.status == 405


# --- errors from the target -----------------------------------------------------------


@pytest.mark.parametrize("reason", list(Reason))
async def test_checkpoint_errors_keep_code_and_status(
    http: aiohttp.ClientSession, base: str, target: FakeTarget, reason: Reason
) -> None:
    target.error = CheckpointError("refused for a reason", reason=reason)
    status, reply = await post(http, url(base, "prepare"), VALID["prepare"])
    assert status == reason.http_status
    assert reply == {"error": {"code": reason.value, "detail": "refused for a reason"}}


async def test_typed_errors_named_by_the_notes(
    http: aiohttp.ClientSession, base: str, target: FakeTarget
) -> None:
    target.error = StaleCheckpoint("ckpt-1 was resumed")
    assert (await post(http, url(base, "prepare"), BASE))[0] == 409
    target.error = InvalidCheckpointState("manifest is corrupt")
    status, reply = await post(http, url(base, "restore"), VALID["restore"])
    assert (status, reply["error"]["code"]) == (422, "invalid_checkpoint_state")
    target.error = CoordinationFailed("x", operation="commit", failures={"a": {"code": "y"}})
    status, reply = await post(http, url(base, "commit"), VALID["commit"])
    assert status == 502
    assert reply["error"]["failures"] == {"a": {"code": "y"}}


async def test_unexpected_error_is_500_and_logged(
    http: aiohttp.ClientSession,
    base: str,
    target: FakeTarget,
    caplog: pytest.LogCaptureFixture,
) -> None:
    target.error = RuntimeError("boom")
    with caplog.at_level(logging.ERROR, logger="ray_ckpt.control.routes"):
        status, reply = await post(http, url(base, "resume"), BASE)
        async with http.get(url(base, "status"), headers=AUTH) as r:
            assert r.status == 500
    assert status == 500
    assert reply == {"error": {"code": "internal", "detail": "RuntimeError: boom"}}
    assert any("resume" in rec.getMessage() and rec.exc_info for rec in caplog.records)


# --- settings -------------------------------------------------------------------------


async def test_no_routes_when_checkpointing_is_off(
    http: aiohttp.ClientSession, serve: Serve, target: FakeTarget
) -> None:
    app = web.Application()
    assert maybe_install_control_routes(app, target, CheckpointSettings()) is False
    base = await serve(app)
    async with http.get(url(base, "status"), headers=AUTH) as r:
        assert r.status == 404
    for op in OPERATIONS:
        async with http.post(url(base, op), headers=AUTH, json=VALID[op]) as r:
            assert r.status == 404
    assert CONTROL_TARGET_KEY not in app
    assert (target.calls, target.status_calls) == ([], 0)


async def test_settings_token_and_limit_are_used(
    http: aiohttp.ClientSession, serve: Serve, target: FakeTarget
) -> None:
    settings = CheckpointSettings(
        enabled=True, control_auth_token=SecretStr("from-settings"), max_control_body_bytes=100
    )
    app = web.Application()
    assert maybe_install_control_routes(app, target, settings) is True
    base = await serve(app)
    headers = {"Authorization": "Bearer from-settings"}
    assert (await post(http, url(base, "prepare"), BASE, headers))[0] == 200
    assert (await post(http, url(base, "prepare"), BASE))[0] == 401
    assert (await post(http, url(base, "prepare"), b" " * 101, headers))[0] == 413


# --- ASGI -----------------------------------------------------------------------------


@pytest.fixture
async def asgi(target: FakeTarget) -> AsyncIterator[httpx.AsyncClient]:
    api = FastAPI()

    @api.get("/hello")
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    wrapped = ControlASGIMiddleware(api, target, token=TOKEN, max_body_bytes=4096)
    transport = httpx.ASGITransport(app=wrapped)
    async with httpx.AsyncClient(transport=transport, base_url="http://gym") as client:
        yield client


@pytest.mark.parametrize("op", OPERATIONS)
async def test_asgi_every_operation(asgi: httpx.AsyncClient, target: FakeTarget, op: str) -> None:
    r = await asgi.post(url("", op), json=VALID[op], headers=AUTH)
    assert (r.status_code, r.json()) == (200, {"op": op, "checkpoint_id": "ckpt-1"})
    assert [o for o, _ in target.calls] == [op]


async def test_asgi_passes_other_routes_through(asgi: httpx.AsyncClient) -> None:
    r = await asgi.get("/hello")
    assert (r.status_code, r.json()) == (200, {"hello": "world"})
    assert (await asgi.get(url("", "explode"), headers=AUTH)).status_code == 404


@pytest.mark.parametrize("headers", BAD_AUTH.values(), ids=BAD_AUTH.keys())
async def test_asgi_bad_token(
    asgi: httpx.AsyncClient, target: FakeTarget, headers: dict[str, str]
) -> None:
    r = await asgi.get(url("", "status"), headers=headers)
    assert (r.status_code, r.json()["error"]["code"]) == (401, "unauthorized")
    r = await asgi.post(url("", "commit"), json=VALID["commit"], headers=headers)
    assert (r.status_code, r.json()["error"]["code"]) == (401, "unauthorized")
    assert (target.calls, target.status_calls) == ([], 0)


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
async def test_asgi_bad_body(asgi: httpx.AsyncClient, target: FakeTarget, body: bytes) -> None:
    r = await asgi.post(url("", "prepare"), content=body, headers=AUTH)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_request")
    assert target.calls == []


async def test_asgi_oversize(asgi: httpx.AsyncClient, target: FakeTarget) -> None:
    r = await asgi.post(url("", "prepare"), content=b" " * 4097, headers=AUTH)
    assert (r.status_code, r.json()["error"]["code"]) == (413, "payload_too_large")

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b" " * 1000

    r = await asgi.post(url("", "prepare"), content=chunks(), headers=AUTH)
    assert (r.status_code, r.json()["error"]["code"]) == (413, "payload_too_large")
    assert target.calls == []


async def test_asgi_errors_and_method(asgi: httpx.AsyncClient, target: FakeTarget) -> None:
    assert (await asgi.get(url("", "prepare"), headers=AUTH)).status_code == 405
    target.error = StaleCheckpoint("ckpt-1 was resumed")
    r = await asgi.post(url("", "prepare"), json=BASE, headers=AUTH)
    assert (r.status_code, r.json()["error"]["code"]) == (409, "stale_checkpoint")
    target.error = InvalidCheckpointState("bad manifest")
    r = await asgi.post(url("", "restore"), json=VALID["restore"], headers=AUTH)
    assert (r.status_code, r.json()["error"]["code"]) == (422, "invalid_checkpoint_state")
    target.error = KeyError("oops")
    r = await asgi.get(url("", "status"), headers=AUTH)
    assert (r.status_code, r.json()["error"]["code"]) == (500, "internal")


# --- the real engine behind the routes ------------------------------------------


@pytest.fixture
async def real(serve: Serve) -> AsyncIterator[tuple[str, ParticipantEngine, FakeParticipant]]:
    participant = FakeParticipant()
    # A small limit: aiohttp lingers up to 10 s on a connection whose large body
    # was left unread, which would only slow the teardown.
    settings = CheckpointSettings(
        enabled=True, control_auth_token=SecretStr(TOKEN), max_control_body_bytes=16 * 1024
    )
    ctl = ParticipantEngine(
        participant, instance="env-0", settings=settings, store=MemoryStore()
    )
    app = web.Application()
    assert maybe_install_control_routes(app, ctl, settings)
    yield await serve(app), ctl, participant
    await ctl.aclose()


async def test_real_controller_rejections_change_nothing(
    http: aiohttp.ClientSession, real: tuple[str, ParticipantEngine, FakeParticipant]
) -> None:
    base, ctl, participant = real
    before = ctl.status()
    for headers in BAD_AUTH.values():
        assert (await post(http, url(base, "prepare"), BASE, headers))[0] == 401
    for bad in BAD_BODIES.values():
        assert (await post(http, url(base, "prepare"), bad))[0] == 400
    too_big = {**BASE, "pad": " " * (20 * 1024)}
    assert (await post(http, url(base, "prepare"), too_big))[0] == 413
    assert ctl.status() == before
    assert participant.admission_open
    # A 401'd resume did not record the ID: a prepare of it still works.
    assert (await post(http, url(base, "resume"), BASE, {}))[0] == 401
    status, reply = await post(http, url(base, "prepare"), BASE)
    assert (status, reply["phase"]) == (200, "prepared")


async def test_real_controller_codes_on_the_wire(
    http: aiohttp.ClientSession, real: tuple[str, ParticipantEngine, FakeParticipant]
) -> None:
    base, _, _ = real
    status, reply = await post(http, url(base, "restore"), VALID["restore"])
    assert (status, reply["error"]["code"]) == (422, "invalid_checkpoint_state")
    assert (await post(http, url(base, "prepare"), BASE))[0] == 200
    other = {**BASE, "checkpoint_id": "ckpt-2"}
    status, reply = await post(http, url(base, "prepare"), other)
    assert (status, reply["error"]["code"]) == (409, "checkpoint_conflict")
    assert await post(http, url(base, "resume"), BASE) == (
        200,
        {"phase": "idle", "idempotent": False},
    )
    status, reply = await post(http, url(base, "prepare"), BASE)
    assert (status, reply["error"]["code"]) == (409, "stale_checkpoint")
    # Past its deadline a ready participant is prepared (the deadline bounds only the wait).
    late = {**other, "deadline_ts": 1.0}
    status, reply = await post(http, url(base, "prepare"), late)
    assert (status, reply["phase"]) == (200, "prepared")
    assert (await post(http, url(base, "resume"), late))[0] == 200
    async with http.get(url(base, "status"), headers=AUTH) as r:
        assert (r.status, (await r.json())["phase"]) == (200, "idle")


async def test_real_controller_behind_asgi() -> None:
    participant = FakeParticipant()
    settings = CheckpointSettings(enabled=True, control_auth_token=SecretStr(TOKEN))
    ctl = ParticipantEngine(
        participant, instance="env-0", settings=settings, store=MemoryStore()
    )
    wrapped = ControlASGIMiddleware(FastAPI(), ctl, token=TOKEN)
    transport = httpx.ASGITransport(app=wrapped)
    async with httpx.AsyncClient(transport=transport, base_url="http://gym") as client:
        r = await client.post(url("", "prepare"), json=BASE)
        assert r.status_code == 401
        assert participant.admission_open
        r = await client.post(url("", "prepare"), json=BASE, headers=AUTH)
        assert (r.status_code, r.json()["phase"]) == (200, "prepared")
        assert not participant.admission_open
        r = await client.post(url("", "prepare"), json={**BASE, "checkpoint_id": "x"}, headers=AUTH)
        assert (r.status_code, r.json()["error"]["code"]) == (409, "checkpoint_conflict")
        r = await client.get(url("", "status"), headers=AUTH)
        assert (r.json()["phase"], r.json()["checkpoint_id"]) == ("prepared", "ckpt-1")
    await ctl.aclose()
