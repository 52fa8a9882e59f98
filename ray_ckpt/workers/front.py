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
- ``GET /stats`` answers for the whole server: every worker's stats merged
  (`merge_stats`), with `workers_answering`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from ray_ckpt.control.routes import is_control_path
from ray_ckpt.errors import CheckpointError, ParticipantUnavailable
from ray_ckpt.gym_server.spec import ROLLOUT
from ray_ckpt.workers.routing import owner_index, rollout_of_body, rollout_of_path

FORWARDED_HEADER = "x-ray-ckpt-worker-forwarded"
# Answered for the whole server: every worker's stats, merged (`merge_stats`).
STATS_PATHS = frozenset({"/stats"})
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
        self.peers_version = -1  # the host's version of `peers` applied last
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

    def set_peers(self, version: int, urls: dict[int, str]) -> bool:
        """Apply the host's peer table if it is newer than the one held.

        The hello reply and the host's broadcasts race on the worker's side: a
        broadcast read while the hello call was resuming must not be undone
        by the older table the hello carried (a peer would then look down
        until the next change)."""
        if version <= self.peers_version:
            return False
        self.peers_version = version
        self.peers = dict(urls)
        return True

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if is_control_path(request.path):
            if self.control_url is None:
                return await handler(request)
            return await self._forward(request, self.control_url)
        if FORWARDED_HEADER in request.headers:
            return await handler(request)
        if request.method == "GET" and request.path in STATS_PATHS and self.workers > 1:
            return await self._all_stats(request, handler)
        if self.spreading != ROLLOUT:
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

    async def _all_stats(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A server's stats are its workers' together (any worker may answer)."""
        mine = await handler(request)
        if not isinstance(mine, web.Response) or mine.status != 200 or mine.body is None:
            return mine
        parts: list[Any] = [orjson.loads(mine.body)]  # type: ignore[arg-type]
        headers = {FORWARDED_HEADER: str(self.index)}
        for index, base in sorted(self.peers.items()):
            if index == self.index:
                continue
            try:
                async with self.session().get(base + request.path_qs, headers=headers) as r:
                    if r.status == 200:
                        parts.append(orjson.loads(await r.read()))
            except (aiohttp.ClientError, orjson.JSONDecodeError):
                continue  # a worker down: the others' stats still answer
        merged = merge_stats(parts)
        merged_out = merged if isinstance(merged, dict) else {"stats": merged}
        merged_out["workers_answering"] = len(parts)
        return web.json_response(merged_out)

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


def merge_stats(parts: list[Any]) -> Any:
    """Every worker's `/stats` as one server's: numbers summed, objects merged
    key by key, lists joined, anything else (a name, a kind) the first one's."""
    if not parts:
        return None
    first = parts[0]
    if all(isinstance(p, int | float) and not isinstance(p, bool) for p in parts):
        return sum(parts)
    if all(isinstance(p, dict) for p in parts):
        keys: dict[str, None] = {}
        for p in parts:
            keys.update(dict.fromkeys(p))
        return {k: merge_stats([p[k] for p in parts if k in p]) for k in keys}
    if all(isinstance(p, list) for p in parts):
        return [x for p in parts for x in p]
    return first
