"""A worker's front: control calls to the host, rollout requests to their owner.

Installed as the first middleware of the worker's aiohttp app:

- A control path (``/ng-control/v1/checkpoint/...``) is forwarded, headers and
  body as they came, to the host's control port: the host answers every
  control call, whichever worker the shared port handed it to.
- With `ROLLOUT` spreading, a request for a rollout another worker owns is
  forwarded to that worker's private loopback port (marked, so it is never
  forwarded twice); the reply streams back as it comes (a model's streamed
  generation stays streamed).  The owner being down is a 503
  `participant_unavailable`, never a silent serve on the wrong worker.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from ray_ckpt.control.routes import is_control_path
from ray_ckpt.errors import CheckpointError, ParticipantUnavailable
from ray_ckpt.workers.routing import ROLLOUT, owner_index, rollout_of_body, rollout_of_path

FORWARDED_HEADER = "x-ray-ckpt-worker-forwarded"
# Not passed along: they describe one hop's connection, not the message.
_HOP = frozenset(
    {
        "host",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "content-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
    }
)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(exc: CheckpointError) -> web.Response:
    return web.json_response(exc.to_body(), status=exc.http_status)


class WorkerFront:
    def __init__(
        self, *, index: int, workers: int, spreading: str, control_url: str | None
    ) -> None:
        self.index = index
        self.workers = workers
        self.spreading = spreading
        self.control_url = control_url
        self.peers: dict[int, str] = {}  # worker index -> private base URL
        self._session: aiohttp.ClientSession | None = None
        self.forwarded = 0  # requests this worker passed to their owner

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No total timeout: a parked /run legitimately waits out a checkpoint.
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
                connector=aiohttp.TCPConnector(limit=1024, limit_per_host=512),
                auto_decompress=False,
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if is_control_path(request.path):
            if self.control_url is None:
                return await handler(request)
            return await self._forward(request, self.control_url)
        if self.spreading != ROLLOUT or FORWARDED_HEADER in request.headers:
            return await handler(request)
        try:
            owner = await self.owner_of(request)
        except CheckpointError as exc:
            return _error(exc)
        if owner is None or owner == self.index:
            return await handler(request)
        peer = self.peers.get(owner)
        if peer is None:
            return _error(ParticipantUnavailable(f"worker w{owner} owning this rollout is down"))
        self.forwarded += 1
        return await self._forward(request, peer)

    async def owner_of(self, request: web.Request) -> int | None:
        rollout = rollout_of_path(request.path)
        if rollout is None and request.method == "POST" and request.can_read_body:
            # The body is cached by aiohttp: the handler still reads it.
            rollout = rollout_of_body(await request.read())
        return None if rollout is None else owner_index(rollout, self.workers)

    async def _forward(self, request: web.Request, base: str) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers[FORWARDED_HEADER] = str(self.index)
        body = await request.read()
        reply: web.StreamResponse | None = None
        try:
            async with self.session().request(
                request.method, base + request.path_qs, data=body, headers=headers
            ) as upstream:
                reply = web.StreamResponse(
                    status=upstream.status,
                    headers={k: v for k, v in upstream.headers.items() if k.lower() not in _HOP},
                )
                await reply.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await reply.write(chunk)
                await reply.write_eof()
                return reply
        except aiohttp.ClientError as exc:
            if reply is not None:
                raise  # mid-stream: the caller sees a torn reply, as from the owner itself
            return _error(ParticipantUnavailable(f"forward to {base} failed: {exc!r}"))


def front_summary(front: WorkerFront) -> dict[str, Any]:
    return {"index": front.index, "forwarded": front.forwarded, "peers": sorted(front.peers)}
