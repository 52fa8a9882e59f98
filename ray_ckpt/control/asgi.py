"""The ASGI front of the control routes, for ASGI apps (e.g. FastAPI).

`ControlASGIMiddleware` answers the control paths itself and hands every
other request to the wrapped app untouched.  It shares `_Gate` with the
aiohttp routes (`ray_ckpt.control.routes`), so both fronts check auth, body
size and errors the same way; only the ASGI message handling lives here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from ray_ckpt.control.routes import (
    CONTROL_ROUTES,
    DEFAULT_MAX_BODY_BYTES,
    BodyTooLarge,
    ControlTarget,
    _Gate,
    is_control_path,
)
from ray_ckpt.errors import InvalidRequest
from ray_ckpt.identity import parse_rollout_path
from ray_ckpt.settings import CheckpointSettings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


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
            rejected = None if path is None else _malformed_data_key(path)
            if rejected is not None:
                await _send(send, *rejected)
                return
            await self.app(scope, receive, send)
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
            await _send(send, *await gate.status())
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
        await _send(send, *await gate.call(op, body))


def _malformed_data_key(path: str) -> tuple[int, bytes] | None:
    """The envelope for a `/ng-rollout/<key>/` path whose key is empty or malformed.

    Checked here, once for every ASGI app, so a key such as ``zz-a1\n`` never
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
