"""The bearer-protected control routes: the shared gate and the aiohttp front.

`GET {prefix}/status` and `POST {prefix}/{op}` for every control operation.
Both fronts (aiohttp here, ASGI in `ray_ckpt.control.asgi`) share one order
of checks through `_Gate`, so a rejected call never reaches the engine:
auth first (before any body byte is read, and before the path or method is
judged, so an unauthenticated caller learns nothing but 401), then the route
and method, then the body size, then the engine, which validates the body
itself.  Every rejection is a JSON `{"error": {"code", "detail"}}` body with
the reason's HTTP status; on aiohttp that also holds for an unmatched path
or method under the data plane's `/ng-rollout/` prefix.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import orjson
from aiohttp import web

from ray_ckpt import tracing
from ray_ckpt.control.listeners import accepting_processes
from ray_ckpt.control.wire import CONTROL_OPERATIONS
from ray_ckpt.errors import CheckpointError, InvalidRequest, Reason
from ray_ckpt.identity import ROLLOUT_PATH_PREFIX, parse_rollout_path
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.tracing import TRACE_HEADERS

log = logging.getLogger(__name__)

CHECKPOINT_ROUTE_PREFIX = "/ng-control/v1/checkpoint"
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
_READ_CHUNK = 64 * 1024
_DATA_PREFIX = f"/{ROLLOUT_PATH_PREFIX}/"

# Every control path and the one method it takes (status: GET, the rest: POST).
CONTROL_ROUTES: dict[str, tuple[str, str | None]] = {
    f"{CHECKPOINT_ROUTE_PREFIX}/status": ("GET", None),
    **{f"{CHECKPOINT_ROUTE_PREFIX}/{op}": ("POST", op) for op in CONTROL_OPERATIONS},
}
# `GET .../status?processes=1` adds which processes accept on the port the
# call came in on (`accepting_processes`, a list of pids, or null where the
# server cannot tell): how a server run by several unmanaged workers is
# recognised for sure (ray_ckpt.workers.detect).  A /proc scan, so on request.
PROCESSES_QUERY = "processes"


def is_control_path(path: str) -> bool:
    """The whole prefix is ours: anything under it is answered by the gate."""
    return path == CHECKPOINT_ROUTE_PREFIX or path.startswith(CHECKPOINT_ROUTE_PREFIX + "/")


class ControlTarget(Protocol):
    """What the routes drive: the participant engine, or a forwarder to it."""

    async def handle(self, op: str, body: bytes | dict[str, Any]) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any]: ...


CONTROL_TARGET_KEY = web.AppKey("ray_ckpt_control_target", ControlTarget)


class BodyTooLarge(Exception):
    pass


def _rejection(reason: Reason, detail: str) -> tuple[int, bytes]:
    return reason.http_status, orjson.dumps({"error": {"code": reason.value, "detail": detail}})


class _Gate:
    """The transport-free part: auth check, size limit, dispatch and error mapping."""

    def __init__(self, target: ControlTarget, token: str, max_body_bytes: int) -> None:
        if not token:
            raise ValueError("control routes need a non-empty bearer token")
        if max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be positive")
        self.target = target
        self.max_body_bytes = max_body_bytes
        self._expected = f"Bearer {token}".encode()

    def authorized(self, headers: Sequence[bytes]) -> bool:
        """Exactly one `Authorization` header, equal to "Bearer <token>".

        Compare the whole header value so "bearer x", "Bearer  x" and
        "Bearer x " are all refused, and in constant time.  Two headers are
        refused whatever they hold: proxies and frameworks disagree on which
        one counts, so "the first decides" is not a rule a caller can rely on.
        """
        return len(headers) == 1 and hmac.compare_digest(headers[0], self._expected)

    def unmatched(self, path: str, method: str) -> tuple[int, bytes, str | None]:
        """An authorized call to a control path or method that does not exist.

        Returns (status, body, the Allow header value for a 405).
        """
        route = CONTROL_ROUTES.get(path)
        if route is None:
            return (*_rejection(Reason.NOT_FOUND, f"no control route {path}"), None)
        allowed = route[0]
        detail = f"{method} is not allowed on {path}; use {allowed}"
        return (*_rejection(Reason.METHOD_NOT_ALLOWED, detail), allowed)

    def declared_too_large(self, content_length: int | None) -> bool:
        return content_length is not None and content_length > self.max_body_bytes

    def unauthorized(self) -> tuple[int, bytes]:
        return _rejection(Reason.UNAUTHORIZED, "missing or wrong bearer token")

    def too_large(self) -> tuple[int, bytes]:
        return _rejection(
            Reason.PAYLOAD_TOO_LARGE, f"control body exceeds {self.max_body_bytes} bytes"
        )

    async def status(self, port: int | None = None) -> tuple[int, bytes]:
        """`port`: the local port of a call that asked for the accepting processes."""
        return await self._run("status", lambda: self._status(port))

    async def call(
        self, op: str, body: bytes, carrier: Mapping[str, str] | None = None
    ) -> tuple[int, bytes]:
        """`carrier`: the request's trace headers (a span of the caller's trace)."""
        attrs = {
            "ray_ckpt.kind": getattr(self.target, "kind", None),
            "ray_ckpt.instance": getattr(self.target, "instance", None),
        }
        with tracing.span(f"ray_ckpt.participant.{op}", attrs, carrier):
            return await self._run(op, lambda: self.target.handle(op, body))

    async def _status(self, port: int | None) -> dict[str, Any]:
        reply = self.target.status()
        if port is not None:
            pids = await asyncio.to_thread(accepting_processes, port)
            reply = {**reply, "accepting_processes": pids}
        return reply

    async def _run(
        self, op: str, work: Callable[[], Awaitable[dict[str, Any]]]
    ) -> tuple[int, bytes]:
        try:
            reply = await work()
            return 200, orjson.dumps(reply)
        except CheckpointError as exc:
            return exc.http_status, orjson.dumps(exc.to_body())
        except Exception as exc:
            # A bug or an unserialisable reply: the caller gets a typed 500 and
            # the operator gets the traceback.
            log.exception("control operation %s failed unexpectedly", op)
            detail = f"{type(exc).__name__}: {exc}"[:500]
            return 500, orjson.dumps({"error": {"code": "internal", "detail": detail}})


# --- aiohttp ------------------------------------------------------------------


def _json(status: int, body: bytes, allow: str | None = None) -> web.Response:
    resp = web.Response(status=status, body=body, content_type="application/json")
    if allow is not None:
        resp.headers["Allow"] = allow
    return resp


def _asked_port(request: web.Request) -> int | None:
    """The local port, if the status call asked for the accepting processes."""
    if request.query.get(PROCESSES_QUERY) != "1" or request.transport is None:
        return None
    local = request.transport.get_extra_info("sockname")
    return local[1] if isinstance(local, tuple) and len(local) >= 2 else None


def _auth_values(request: web.Request) -> list[bytes]:
    values = request.headers.getall("Authorization", [])
    return [h.encode("utf-8", "surrogateescape") for h in values]


def _too_large(gate: _Gate) -> web.Response:
    resp = _json(*gate.too_large())
    # The unread rest of the body makes the connection useless: tell the client
    # to drop it instead of leaving the server draining it.
    resp.force_close()
    return resp


async def _read_limited(request: web.Request, limit: int) -> bytes:
    # Read from the stream directly: request.read() applies the app's
    # client_max_size, which belongs to whoever owns the app, not to us.
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.content.iter_chunked(_READ_CHUNK):
        total += len(chunk)
        if total > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _aiohttp_handlers(
    gate: _Gate,
) -> tuple[
    Callable[[web.Request], Awaitable[web.Response]],
    Callable[[str], Callable[[web.Request], Awaitable[web.Response]]],
]:
    def authorized(request: web.Request) -> bool:
        return gate.authorized(_auth_values(request))

    async def status(request: web.Request) -> web.Response:
        if not authorized(request):
            return _json(*gate.unauthorized())
        return _json(*await gate.status(_asked_port(request)))

    def operation(op: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            if not authorized(request):
                return _json(*gate.unauthorized())
            if gate.declared_too_large(request.content_length):
                return _too_large(gate)
            try:
                body = await _read_limited(request, gate.max_body_bytes)
            except BodyTooLarge:
                return _too_large(gate)
            carrier = {h: request.headers[h] for h in TRACE_HEADERS if h in request.headers}
            return _json(*await gate.call(op, body, carrier))

        return handler

    return status, operation


def _envelope_middleware(gate: _Gate) -> Any:
    """Typed JSON replies where aiohttp's router would answer plain text.

    Only requests the router could not match are touched (the router's own
    404/405): under the control prefix the token is checked first, then the
    envelope names the missing route or the allowed method; under
    `/ng-rollout/` a malformed capture key is 400 `invalid_request` and
    anything else the envelope of the router's 404/405.  Other paths belong to
    the Gym app and keep its behaviour.
    """

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        unmatched = request.match_info.http_exception
        if unmatched is None:
            return await handler(request)
        path = request.path
        if is_control_path(path):
            if not gate.authorized(_auth_values(request)):
                return _json(*gate.unauthorized())
            return _json(*gate.unmatched(path, request.method))
        if not path.startswith(_DATA_PREFIX):
            return await handler(request)
        try:
            parse_rollout_path(path)
        except InvalidRequest as exc:
            return _json(exc.http_status, orjson.dumps(exc.to_body()))
        if unmatched.status == 405:
            allow = unmatched.headers.get("Allow", "")
            detail = f"{request.method} is not allowed on {path}; use {allow}"
            return _json(*_rejection(Reason.METHOD_NOT_ALLOWED, detail), allow)
        if unmatched.status == 404:
            return _json(*_rejection(Reason.NOT_FOUND, f"no data route {path}"))
        return await handler(request)

    return middleware


def install_control_routes(
    app: web.Application,
    target: ControlTarget,
    *,
    token: str,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> None:
    """Mount the control routes on `app` (which may serve other routes too)."""
    gate = _Gate(target, token, max_body_bytes)
    if CONTROL_TARGET_KEY in app:
        raise ValueError("control routes are already installed on this app")
    app[CONTROL_TARGET_KEY] = target
    app.middlewares.append(_envelope_middleware(gate))
    status, operation = _aiohttp_handlers(gate)
    app.router.add_get(f"{CHECKPOINT_ROUTE_PREFIX}/status", status, allow_head=False)
    for op in CONTROL_OPERATIONS:
        app.router.add_post(f"{CHECKPOINT_ROUTE_PREFIX}/{op}", operation(op))


def control_app(
    target: ControlTarget, *, token: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> web.Application:
    """An app serving only the control routes (sidecars and tests)."""
    app = web.Application()
    install_control_routes(app, target, token=token, max_body_bytes=max_body_bytes)
    return app


def maybe_install_control_routes(
    app: web.Application, target: ControlTarget, settings: CheckpointSettings
) -> bool:
    """Install the routes only when checkpointing is on; True if installed."""
    if not settings.enabled:
        return False
    install_control_routes(
        app, target, token=settings.token, max_body_bytes=settings.max_control_body_bytes
    )
    return True
