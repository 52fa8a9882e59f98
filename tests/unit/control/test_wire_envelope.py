"""Every bad request gets a typed reply, on both fronts, over real loopback HTTP.

The aiohttp front is a real `web.Application` with the control routes and a
data route; the ASGI front is a real FastAPI app behind
`ControlASGIMiddleware`, served by uvicorn on a bound socket.  Both drive a
real `ParticipantEngine`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from multidict import CIMultiDict
from pydantic import SecretStr

from ray_ckpt.control.asgi import ControlASGIMiddleware
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.control.routes import CHECKPOINT_ROUTE_PREFIX, maybe_install_control_routes
from ray_ckpt.control.wire import OPERATIONS
from ray_ckpt.errors import CheckpointError, NotFound
from ray_ckpt.gym_server.serving import bind_socket, serve_app, socket_address
from ray_ckpt.identity import EpisodeId
from ray_ckpt.settings import CheckpointSettings
from tests.unit.conftest import Serve
from tests.unit.fakes import FakeParticipant, MemoryStore

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BASE = {"checkpoint_id": "ckpt-1", "deadline_ts": 2_000_000_000.0}
EP = [{"rollout_id": "r1", "attempt": 0}]
VALID: dict[str, dict[str, Any]] = {
    "prepare": BASE,
    "renew": BASE,
    "resume": BASE,
    "commit": {**BASE, "checkpoint_dir": "/tmp/ck", "episode_ids": EP},
    "restore": {**BASE, "checkpoint_dir": "/tmp/ck", "episode_ids": EP},
    "retire": {**BASE, "episode_ids": EP},
    "forget": {**BASE, "rollout_ids": ["r1"]},
}
WRONG_METHODS = ["GET", "PUT", "DELETE", "PATCH", "OPTIONS"]


def ctl_url(base: str, op: str) -> str:
    return f"{base}{CHECKPOINT_ROUTE_PREFIX}/{op}"


def settings() -> CheckpointSettings:
    return CheckpointSettings(enabled=True, control_auth_token=SecretStr(TOKEN))


async def _echo_episode(key: str) -> dict[str, Any]:
    episode = EpisodeId.from_capture_key(key)
    if episode.rollout_id == "gone":
        raise NotFound(f"no session {key}")
    return {"rollout": episode.rollout_id, "attempt": episode.attempt}


def aiohttp_app(ctl: ParticipantEngine) -> web.Application:
    app = web.Application()

    async def echo(request: web.Request) -> web.Response:
        try:
            return web.json_response(await _echo_episode(request.match_info["key"]))
        except CheckpointError as exc:
            return web.json_response(exc.to_body(), status=exc.http_status)

    app.router.add_post("/ng-rollout/{key}/echo", echo)

    async def plain(_: web.Request) -> web.Response:
        return web.Response(text="plain")

    app.router.add_get("/plain", plain)
    assert maybe_install_control_routes(app, ctl, settings())
    return app


async def serve_asgi(ctl: ParticipantEngine) -> tuple[str, Any]:
    api = FastAPI()

    @api.post("/ng-rollout/{key}/echo", response_model=None)
    async def echo(key: str) -> dict[str, Any] | JSONResponse:
        try:
            return await _echo_episode(key)
        except CheckpointError as exc:
            return JSONResponse(exc.to_body(), status_code=exc.http_status)

    sock = bind_socket("127.0.0.1", 0)
    serving = await serve_app(ControlASGIMiddleware.from_settings(api, ctl, settings()), sock)
    host, port = socket_address(sock)
    return f"http://{host}:{port}", serving


@pytest.fixture(params=["aiohttp", "asgi"])
async def front(
    request: pytest.FixtureRequest, serve: Serve
) -> AsyncIterator[tuple[str, str, ParticipantEngine]]:
    ctl = ParticipantEngine(
        FakeParticipant(), instance="env-0", settings=settings(), store=MemoryStore()
    )
    if request.param == "aiohttp":
        yield request.param, await serve(aiohttp_app(ctl)), ctl
    else:
        base, serving = await serve_asgi(ctl)
        yield request.param, base, ctl
        await serving.stop()
    await ctl.aclose()


async def call(
    http: aiohttp.ClientSession,
    method: str,
    where: str,
    *,
    headers: Any = None,
    json: Any = None,
) -> tuple[int, Any, aiohttp.typedefs.LooseHeaders]:
    async with http.request(method, where, headers=headers, json=json) as r:
        raw = await r.read()
        try:
            body = await r.json(content_type=None) if raw else None
        except ValueError:
            body = raw.decode()
        return r.status, body, r.headers


def assert_envelope(body: Any, code: str) -> None:
    assert isinstance(body, dict), body
    assert set(body) == {"error"}, body
    assert body["error"]["code"] == code, body
    assert isinstance(body["error"]["detail"], str)


# --- IDs are matched in full ----------------------------------------------------


@pytest.mark.parametrize("op", OPERATIONS)
async def test_checkpoint_id_with_trailing_newline_is_400(
    http: aiohttp.ClientSession, front: tuple[str, str, ParticipantEngine], op: str
) -> None:
    _, base, ctl = front
    before = ctl.status()
    body = {**VALID[op], "checkpoint_id": "abc\n"}
    status, reply, _ = await call(http, "POST", ctl_url(base, op), headers=AUTH, json=body)
    assert status == 400
    assert_envelope(reply, "invalid_request")
    assert ctl.status() == before


@pytest.mark.parametrize(
    ("op", "body"),
    [
        ("retire", {**BASE, "episode_ids": [{"rollout_id": "r\n", "attempt": 0}]}),
        ("forget", {**BASE, "rollout_ids": ["r\n"]}),
        ("commit", {**VALID["commit"], "episode_ids": [{"rollout_id": "r2\n"}]}),
    ],
)
async def test_episode_ids_with_trailing_newline_are_400(
    http: aiohttp.ClientSession,
    front: tuple[str, str, ParticipantEngine],
    op: str,
    body: dict[str, Any],
) -> None:
    _, base, ctl = front
    status, reply, _ = await call(http, "POST", ctl_url(base, op), headers=AUTH, json=body)
    assert status == 400
    assert_envelope(reply, "invalid_request")
    assert ctl.status()["phase"] == "idle"


async def test_data_plane_key_with_newline_is_not_another_key(
    http: aiohttp.ClientSession, front: tuple[str, str, ParticipantEngine]
) -> None:
    _, base, _ = front
    status, reply, _ = await call(http, "POST", f"{base}/ng-rollout/zz-a1/echo")
    assert (status, reply) == (200, {"rollout": "zz", "attempt": 1})
    for key in ("zz-a1%0A", "zz%0A", "zz-a1%0D", "zz%00"):
        status, reply, _ = await call(http, "POST", f"{base}/ng-rollout/{key}/echo")
        assert status == 400, key
        assert_envelope(reply, "invalid_request")


# --- wrong method / unknown route under the control prefix ------------------------


@pytest.mark.parametrize("method", WRONG_METHODS)
async def test_wrong_method_is_json_405_after_the_token(
    http: aiohttp.ClientSession, front: tuple[str, str, ParticipantEngine], method: str
) -> None:
    _, base, ctl = front
    for op in OPERATIONS:
        status, reply, _ = await call(http, method, ctl_url(base, op))
        assert status == 401, (method, op)
        assert_envelope(reply, "unauthorized")
        status, reply, headers = await call(http, method, ctl_url(base, op), headers=AUTH)
        assert status == 405, (method, op)
        assert_envelope(reply, "method_not_allowed")
        assert headers["Allow"] == "POST"
    if method != "GET":
        status, reply, _ = await call(http, method, ctl_url(base, "status"))
        assert status == 401
        status, reply, headers = await call(http, method, ctl_url(base, "status"), headers=AUTH)
        assert status == 405
        assert_envelope(reply, "method_not_allowed")
        assert headers["Allow"] == "GET"
    assert ctl.status()["phase"] == "idle"


@pytest.mark.parametrize("path", ["explode", "", "status/", "prepare/x", "prepare%0A"])
async def test_unknown_control_path_is_401_then_json_404(
    http: aiohttp.ClientSession, front: tuple[str, str, ParticipantEngine], path: str
) -> None:
    _, base, _ = front
    where = f"{base}{CHECKPOINT_ROUTE_PREFIX}/{path}"
    for method in ("GET", "POST"):
        status, reply, _ = await call(http, method, where)
        assert status == 401, (method, path)
        assert_envelope(reply, "unauthorized")
        status, reply, _ = await call(http, method, where, headers=AUTH)
        assert status in (404, 405), (method, path)
        assert_envelope(reply, "not_found" if status == 404 else "method_not_allowed")


async def test_head_on_status_is_refused_after_the_token(
    http: aiohttp.ClientSession, front: tuple[str, str, ParticipantEngine]
) -> None:
    _, base, _ = front
    assert (await call(http, "HEAD", ctl_url(base, "status")))[0] == 401
    assert (await call(http, "HEAD", ctl_url(base, "status"), headers=AUTH))[0] == 405


# --- two Authorization headers ------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        [f"Bearer {TOKEN}", f"Bearer {TOKEN}"],
        [f"Bearer {TOKEN}", "Bearer nope"],
        ["Bearer nope", f"Bearer {TOKEN}"],
    ],
    ids=["same", "good_first", "good_last"],
)
async def test_two_authorization_headers_are_401(
    http: aiohttp.ClientSession, front: tuple[str, str, ParticipantEngine], values: list[str]
) -> None:
    _, base, ctl = front
    headers = CIMultiDict([("Authorization", v) for v in values])
    status, reply, _ = await call(http, "GET", ctl_url(base, "status"), headers=headers)
    assert status == 401
    assert_envelope(reply, "unauthorized")
    status, reply, _ = await call(
        http, "POST", ctl_url(base, "prepare"), headers=headers, json=BASE
    )
    assert status == 401
    assert ctl.status()["phase"] == "idle"
    # One correct header still works.
    status, reply, _ = await call(http, "POST", ctl_url(base, "prepare"), headers=AUTH, json=BASE)
    assert (status, reply["phase"]) == (200, "prepared")


# --- the data plane's unmatched paths -----------------------------------------------


async def test_data_plane_empty_key_is_json_400(
    http: aiohttp.ClientSession, front: tuple[str, str, ParticipantEngine]
) -> None:
    _, base, _ = front
    for method in ("POST", "GET"):
        status, reply, _ = await call(http, method, f"{base}/ng-rollout//echo")
        assert status == 400
        assert_envelope(reply, "invalid_request")


async def test_data_plane_unmatched_is_json(
    http: aiohttp.ClientSession, front: tuple[str, str, ParticipantEngine]
) -> None:
    _, base, _ = front
    status, reply, _ = await call(http, "POST", f"{base}/ng-rollout/r/nope")
    assert status == 404
    assert_envelope(reply, "not_found")
    status, reply, headers = await call(http, "GET", f"{base}/ng-rollout/r/echo")
    assert status == 405
    assert_envelope(reply, "method_not_allowed")
    assert "POST" in headers["Allow"]
    status, reply, _ = await call(http, "POST", f"{base}/ng-rollout/")
    assert status == 400
    assert_envelope(reply, "invalid_request")
    # A typed error of the app itself passes through unchanged.
    status, reply, _ = await call(http, "POST", f"{base}/ng-rollout/gone/echo")
    assert status == 404
    assert reply == {"error": {"code": "not_found", "detail": "no session gone"}}
    # Paths outside the reserved prefixes keep the Gym app's own behaviour.
    status, reply, _ = await call(http, "GET", f"{base}/nope")
    assert status == 404
    assert not isinstance(reply, dict) or "error" not in reply
