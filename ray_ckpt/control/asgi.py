"""The ASGI front of the control routes, for ASGI apps (e.g. FastAPI).

`ControlASGIMiddleware` answers the control paths itself and hands every
other request to the wrapped app untouched.  It shares `_Gate` with the
aiohttp routes (`ray_ckpt.control.routes`), so both fronts check auth, body
size and errors the same way; only the ASGI message handling lives here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ray_ckpt.control.routes import (
    CHECKPOINT_ROUTE_PREFIX,
    DEFAULT_MAX_BODY_BYTES,
    BodyTooLarge,
    ControlTarget,
    _Gate,
)
from ray_ckpt.control.wire import OPERATIONS
from ray_ckpt.settings import CheckpointSettings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_ASGI_ROUTES: dict[str, tuple[str, str | None]] = {
    f"{CHECKPOINT_ROUTE_PREFIX}/status": ("GET", None),
    **{f"{CHECKPOINT_ROUTE_PREFIX}/{op}": ("POST", op) for op in OPERATIONS},
}


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
        route = _ASGI_ROUTES.get(_route_path(scope)) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        method, op = route
        if scope["method"] != method:
            await _send(
                send,
                405,
                b'{"error":{"code":"method_not_allowed","detail":""}}',
                extra=[(b"allow", method.encode())],
            )
            return
        headers = dict(scope.get("headers") or [])
        gate = self._gate
        if not gate.authorized(headers.get(b"authorization")):
            await _send(send, *gate.unauthorized())
            return
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
