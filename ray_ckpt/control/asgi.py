"""The ASGI front of the control routes, for ASGI apps (e.g. FastAPI).

`ControlASGIMiddleware` answers the control paths itself and hands every
other request to the wrapped app.  It shares `_Gate` with the aiohttp routes
(`ray_ckpt.control.routes`), so both fronts check auth, body size and errors
the same way; only the ASGI message handling lives here.  Under the data
plane's `/ng-rollout/` prefix it also keeps the error contract the aiohttp
front keeps: a malformed capture key is 400 `invalid_request` before the app
sees it, and a 404/405 the app's framework answers in its own shape (FastAPI's
`{"detail": "Not Found"}`) becomes the `{"error": {"code", "detail"}}`
envelope; every other reply passes through untouched.  `send_error` and
`send_json` let a data-plane front in front of an app (the NeMo Gym wrapper,
`participants.nemo_gym.front`) answer in the same envelope.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

import orjson

from ray_ckpt.control.routes import (
    CONTROL_ROUTES,
    DEFAULT_MAX_BODY_BYTES,
    PROCESSES_QUERY,
    BodyTooLarge,
    ControlTarget,
    _Gate,
    is_control_path,
)
from ray_ckpt.errors import CheckpointError, InvalidRequest, Reason
from ray_ckpt.identity import ROLLOUT_PATH_PREFIX, parse_rollout_path
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.tracing import TRACE_HEADERS

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_DATA_PREFIX = f"/{ROLLOUT_PATH_PREFIX}/"
_UNMATCHED = {404: Reason.NOT_FOUND, 405: Reason.METHOD_NOT_ALLOWED}
# A framework's own 404/405 body is small; a larger one is passed through as is.
_MAX_REWRITE = 64 * 1024


class ControlASGIMiddleware:
    """Answers the control routes in front of an ASGI app (e.g. FastAPI).

    Pure ASGI rather than a framework middleware, so the wrapped app's own
    middleware never sees, buffers or re-orders control traffic.
    """

    def __init__(
        self,
        app: ASGIApp,
        target: ControlTarget,
        *,
        token: str,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.app = app
        self._gate = _Gate(target, token, max_body_bytes)

    @classmethod
    def from_settings(
        cls, app: ASGIApp, target: ControlTarget, settings: CheckpointSettings
    ) -> ControlASGIMiddleware:
        """In front of `app`, with the settings' token and body limit."""
        limit = settings.max_control_body_bytes
        return cls(app, target, token=settings.token, max_body_bytes=limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = _route_path(scope) if scope["type"] == "http" else None
        if path is None or not is_control_path(path):
            if path is None or not path.startswith(_DATA_PREFIX):
                await self.app(scope, receive, send)
                return
            rejected = _malformed_data_key(path)
            if rejected is not None:
                await _send(send, *rejected)
                return
            await self.app(scope, receive, _EnvelopeSend(send, scope["method"], path))
            return
        raw_headers: list[tuple[bytes, bytes]] = list(scope.get("headers") or [])
        gate = self._gate
        # The token first, for every path under the prefix: an unauthenticated
        # caller learns nothing about routes or methods before its 401.
        auth = [value for name, value in raw_headers if name.lower() == b"authorization"]
        if not gate.authorized(auth):
            await _send(send, *gate.unauthorized())
            return
        route = CONTROL_ROUTES.get(path)
        if route is None or scope["method"] != route[0]:
            code, reply, allow = gate.unmatched(path, scope["method"])
            extra = None if allow is None else [(b"allow", allow.encode())]
            await _send(send, code, reply, extra=extra)
            return
        op = route[1]
        headers = dict(raw_headers)
        if op is None:
            await _send(send, *await gate.status(_asked_port(scope)))
            return
        if gate.declared_too_large(_content_length(headers.get(b"content-length"))):
            await _send(send, *gate.too_large())
            return
        try:
            body = await _receive_limited(receive, gate.max_body_bytes)
        except BodyTooLarge:
            await _send(send, *gate.too_large())
            return
        if body is None:
            return  # the client went away; nobody to answer
        carrier = {
            name: headers[name.encode()].decode("latin-1")
            for name in TRACE_HEADERS
            if name.encode() in headers
        }
        await _send(send, *await gate.call(op, body, carrier))


class _EnvelopeSend:
    """Rewrites a 404/405 reply that is not already the error envelope."""

    def __init__(self, send: Send, method: str, path: str) -> None:
        self._send = send
        self._method = method
        self._path = path
        self._start: Message | None = None
        self._chunks: list[bytes] = []
        self._size = 0

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start" and message.get("status") in _UNMATCHED:
            self._start = message  # held until the body shows whose reply it is
            return
        if self._start is None or kind != "http.response.body":
            await self._send(message)
            return
        chunk: bytes = message.get("body", b"")
        self._chunks.append(chunk)
        self._size += len(chunk)
        more = bool(message.get("more_body", False))
        if self._size > _MAX_REWRITE:
            await self._flush(more)
        elif not more:
            await self._finish()

    async def _flush(self, more: bool) -> None:
        start, self._start = self._start, None
        assert start is not None
        await self._send(start)
        body, self._chunks = b"".join(self._chunks), []
        await self._send({"type": "http.response.body", "body": body, "more_body": more})

    async def _finish(self) -> None:
        start = self._start
        assert start is not None
        body = b"".join(self._chunks)
        if _is_envelope(body):
            await self._flush(False)  # the app's own typed error (e.g. an unknown session)
            return
        self._start = None
        status: int = start["status"]
        text = body[:200].decode("utf-8", "replace")
        detail = f"{self._method} {self._path}: {text}" if text else f"{self._method} {self._path}"
        reply = orjson.dumps({"error": {"code": _UNMATCHED[status].value, "detail": detail}})
        allow = [(k, v) for k, v in start.get("headers", []) if k.lower() == b"allow"]
        await _send(self._send, status, reply, extra=allow)


def _is_envelope(body: bytes) -> bool:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    err = parsed.get("error") if isinstance(parsed, dict) else None
    return isinstance(err, dict) and isinstance(err.get("code"), str)


def _malformed_data_key(path: str) -> tuple[int, bytes] | None:
    """The envelope for a `/ng-rollout/<key>/` path whose key is empty or malformed.

    Checked here, once for every ASGI app, so a key such as ``zz-a1\\n`` never
    reaches a Gym route that might read it as episode ``zz`` attempt 1.
    """
    try:
        parse_rollout_path(path)
    except InvalidRequest as exc:
        return exc.http_status, orjson.dumps(exc.to_body())
    return None


def _route_path(scope: Scope) -> str:
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path


def _content_length(raw: bytes | None) -> int | None:
    try:
        return None if raw is None else int(raw)
    except ValueError:
        return None


async def _receive_limited(receive: Receive, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk: bytes = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _asked_port(scope: Scope) -> int | None:
    """The local port, if the status call asked for the accepting processes."""
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    server = scope.get("server")
    if query.get(PROCESSES_QUERY) != ["1"] or not server or server[1] is None:
        return None
    return int(server[1])


async def _send(
    send: Send, status: int, body: bytes, *, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, exc: CheckpointError) -> None:
    """Answer with the typed error's status and `{"error": {"code", "detail"}}` body.

    For data-plane fronts in front of an ASGI app (e.g. a NeMo Gym wrapper's
    `stale_attempt`), so every front answers refusals in the one envelope.
    """
    await _send(send, exc.http_status, orjson.dumps(exc.to_body()))


async def send_json(send: Send, body: object, *, status: int = 200) -> None:
    """A complete JSON reply (a front answering a route the app lacks)."""
    await _send(send, status, orjson.dumps(body))
