"""The worker front for ASGI (FastAPI) apps: the same rules as `front`.

Control paths go to the host's control port; with `ROLLOUT` spreading a
request for a rollout another worker owns is forwarded to that worker's
private port, its reply streamed back; a body is read (bounded) only when the
path names no rollout and the method is POST, then replayed to the app.
`GET /stats` merging is the aiohttp front's only (an ASGI app's stats are
the answering worker's).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from ray_ckpt.control.asgi import ASGIApp, Message, Receive, Scope, Send
from ray_ckpt.control.routes import is_control_path
from ray_ckpt.errors import CheckpointError, ParticipantUnavailable, Reason
from ray_ckpt.gym_server.spec import ROLLOUT
from ray_ckpt.workers.front import _HOP, FORWARDED_HEADER, WorkerFront
from ray_ckpt.workers.routing import owner_index, rollout_of_body, rollout_of_path

# A body this front reads (to find its rollout, or to forward it) is bounded.
MAX_FORWARD_BODY_BYTES = 64 * 1024 * 1024
_FORWARDED = FORWARDED_HEADER.encode()


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_FORWARD_BODY_BYTES:
            raise CheckpointError(
                f"body over {MAX_FORWARD_BODY_BYTES} bytes", reason=Reason.PAYLOAD_TOO_LARGE
            )
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # then the disconnect, as from the server

    return again


async def _error(send: Send, exc: CheckpointError) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": exc.http_status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": orjson.dumps(exc.to_body())})


class ASGIWorkerFront:
    def __init__(self, app: ASGIApp, front: WorkerFront) -> None:
        self.app = app
        self.front = front

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self._http(scope, receive, send)
        except CheckpointError as exc:
            await _error(send, exc)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        front, path = self.front, str(scope["path"])
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers", []))
        if is_control_path(path) and front.control_url is not None:
            call = await _read_body(receive)
            await self._forward(scope, headers, call, front.control_url, send)
            return
        forwarded = any(k.lower() == _FORWARDED for k, _ in headers)
        if forwarded or front.spreading != ROLLOUT:
            await self.app(scope, receive, send)
            return
        rollout = rollout_of_path(path)
        body: bytes | None = None
        if rollout is None and scope.get("method") == "POST":
            body = await _read_body(receive)
            rollout = rollout_of_body(body)
            receive = _replay(body, receive)
        owner = None if rollout is None else owner_index(rollout, front.workers)
        if owner is None or owner == front.index:
            await self.app(scope, receive, send)
            return
        peer = front.peers.get(owner)
        if peer is None:
            raise ParticipantUnavailable(f"worker w{owner} owning this rollout is down")
        front.forwarded += 1
        if body is None:
            body = await _read_body(receive)
        await self._forward(scope, headers, body, peer, send)

    async def _forward(
        self, scope: Scope, headers: list[tuple[bytes, bytes]], body: bytes, base: str, send: Send
    ) -> None:
        out = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in headers
            if k.decode("latin-1").lower() not in _HOP
        }
        out[FORWARDED_HEADER] = str(self.front.index)
        query = scope.get("query_string", b"")
        url = base + str(scope["path"]) + (("?" + query.decode("latin-1")) if query else "")
        started = False
        try:
            async with self.front.session().request(
                str(scope["method"]), url, data=body, headers=out
            ) as upstream:
                reply: list[tuple[bytes, bytes]] = [
                    (k.encode("latin-1"), v.encode("latin-1"))
                    for k, v in upstream.headers.items()
                    if k.lower() not in _HOP
                ]
                await send(
                    {"type": "http.response.start", "status": upstream.status, "headers": reply}
                )
                started = True
                async for chunk in upstream.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except aiohttp.ClientError as exc:
            if started:
                raise
            raise ParticipantUnavailable(f"forward to {base} failed: {exc!r}") from None


def asgi_front(app: Any, front: WorkerFront) -> ASGIWorkerFront:
    return ASGIWorkerFront(app, front)
