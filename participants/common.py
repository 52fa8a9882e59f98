"""Plumbing shared by the reference Gym servers: JSON edges, downstream calls, stats.

Every data route answers a rejection with the `{"error": {"code", "detail"}}`
body of its typed error, so a caller can tell `stale_attempt` (retired),
`admission_closed` (retry after resume), a 404 (unknown session) and a 400
(malformed body) apart.  Downstream calls raise the typed error the callee
answered with.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from ray_ckpt.control.client import data_session
from ray_ckpt.errors import (
    CheckpointError,
    InvalidRequest,
    ParticipantUnavailable,
    error_from_body,
)
from ray_ckpt.identity import EpisodeId

if TYPE_CHECKING:
    from ray_ckpt.control.engine import ParticipantEngine

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# A rollout job holds many calls open to one server at once (parked /run
# calls during a checkpoint): size the data pool for that, not for a browser.
DATA_POOL_LIMIT = 1024
DATA_POOL_PER_HOST = 512

# The caller's position of a model call in its episode: how many model calls
# its session had made before this one.  A call re-issued after a restore
# carries the same position, so the model's ledger replaces the row of the
# delivery the caller dropped instead of adding a second one.
MODEL_CALL_HEADER = "x-ng-model-call"


def error_response(exc: CheckpointError) -> web.Response:
    return web.json_response(exc.to_body(), status=exc.http_status)


def guarded(handler: Handler) -> Handler:
    """Answer a typed error with its status and body instead of a 500."""

    async def wrapper(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except CheckpointError as exc:
            return error_response(exc)

    return wrapper


def episode_of(request: web.Request) -> EpisodeId:
    """The episode attempt named by the `/ng-rollout/<key>/` prefix (400 if malformed)."""
    return EpisodeId.from_capture_key(request.match_info["key"])


async def json_object(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    return body


def want_int(body: Mapping[str, Any], field: str, *, low: int = 0, high: int = 2**62) -> int:
    value = body.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequest(f"{field!r} must be an integer in [{low}, {high}], got {value!r}")
    return value


def want_str(body: Mapping[str, Any], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{field!r} must be a non-empty string, got {value!r}")
    return value


def digest(value: Any) -> str:
    """A stable digest of JSON data (keys sorted, so dict order does not matter)."""
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).hexdigest()


class Downstream:
    """A lazily opened data-plane session (servers are built outside their loop)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = data_session(DATA_POOL_LIMIT, DATA_POOL_PER_HOST)
        return self._session

    async def post(
        self, url: str, body: Any, extra_headers: Mapping[str, str] | None = None
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """POST JSON; the reply object and headers, or the callee's typed error."""
        sent = {"Content-Type": "application/json", **(extra_headers or {})}
        try:
            async with self.session().post(url, data=orjson.dumps(body), headers=sent) as resp:
                status, raw, headers = resp.status, await resp.read(), dict(resp.headers)
        except aiohttp.ClientError as exc:
            raise ParticipantUnavailable(f"POST {url} failed: {exc!r}") from None
        try:
            payload: Any = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            payload = raw[:200].decode("utf-8", "replace")
        if status >= 400:
            raise error_from_body(status, payload)
        if not isinstance(payload, dict):
            raise ParticipantUnavailable(f"POST {url}: reply is not a JSON object")
        return payload, headers

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


class ServerBase:
    """What every reference server shares: name, engine, stats, downstream pool."""

    kind: str

    def __init__(self, name: str) -> None:
        self.name = name
        self.engine: ParticipantEngine | None = None
        self.calls: Counter[str] = Counter()  # per route
        self.downstream = Downstream()

    def attach(self, engine: ParticipantEngine) -> None:
        self.engine = engine

    def check_attempt(self, episode: EpisodeId) -> None:
        """Refuse a retired attempt (`stale_attempt`); a no-op with checkpointing off."""
        if self.engine is not None:
            self.engine.retired.check(episode)

    async def aclose(self) -> None:
        await self.downstream.aclose()

    def base_stats(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "calls": dict(self.calls)}

    async def stats_route(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    def stats(self) -> dict[str, Any]:
        return self.base_stats()
