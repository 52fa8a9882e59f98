"""The control client and its reserved connection pool.

Data calls can hold every connection a pool allows to a host for as long as a
rollout step takes.  Control calls (prepare, commit, resume, ...) travel over
a connector of their own, so a saturated data pool never starves a
checkpoint.  Both pools are built by `_connector`, so they share keepalive
behaviour and differ only in their limits.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

import aiohttp
import msgspec
import orjson

from ray_ckpt import tracing
from ray_ckpt.clock import SYSTEM_CLOCK, Clock
from ray_ckpt.control.routes import CHECKPOINT_ROUTE_PREFIX, PROCESSES_QUERY
from ray_ckpt.control.wire import CONTROL_OPERATIONS
from ray_ckpt.errors import (
    CheckpointError,
    CoordinationFailed,
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    ParticipantUnavailable,
    Reason,
    Unauthorized,
    error_from_body,
    validation_error,
)
from ray_ckpt.settings import CheckpointSettings

# Idle connections live long enough to span the gaps between control phases
# (prepare → commit → resume) without a reconnect, and no longer.
KEEPALIVE_TIMEOUT_S = 30.0
DEFAULT_TIMEOUT_S = 30.0
# Added to the remaining time of a call so the participant's own
# `deadline_exceeded` reply wins the race against our timeout.
REPLY_GRACE_S = 5.0

_encode = msgspec.json.Encoder().encode
_KNOWN_CODES = frozenset(r.value for r in Reason)


def _connector(limit: int, limit_per_host: int) -> aiohttp.TCPConnector:
    # enable_cleanup_closed only matters for TLS and is deprecated on newer
    # Pythons (a warning is an error in our tests); control traffic is plain HTTP.
    return aiohttp.TCPConnector(
        limit=limit,
        limit_per_host=limit_per_host,
        keepalive_timeout=KEEPALIVE_TIMEOUT_S,
    )


def data_session(limit: int, limit_per_host: int) -> aiohttp.ClientSession:
    """A data-plane session (call inside a running loop); close it when done."""
    return aiohttp.ClientSession(connector=_connector(limit, limit_per_host))


class ControlClient:
    """Bearer-authenticated control calls to one participant's routes.

    The session is created on first use, so the client can be built outside an
    event loop (e.g. in a Ray actor's `__init__`).  Calls raise the typed error
    the participant answered with; an unreachable participant raises
    `ParticipantUnavailable`.  Every operation is idempotent on the
    participant, so callers may retry.
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str,
        limit: int,
        limit_per_host: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        grace_s: float = REPLY_GRACE_S,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not token:
            raise ValueError("a control client needs a non-empty bearer token")
        if limit <= 0 or limit_per_host <= 0:
            raise ValueError("the control pool needs positive limits")
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self._limits = (limit, limit_per_host)
        self._timeout_s = timeout_s
        self._grace_s = grace_s
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    @classmethod
    def from_settings(
        cls, base_url: str, settings: CheckpointSettings, **kwargs: Any
    ) -> ControlClient:
        return cls(
            base_url,
            token=settings.token,
            limit=settings.global_aiohttp_control_connector_limit,
            limit_per_host=settings.global_aiohttp_control_connector_limit_per_host,
            **kwargs,
        )

    def __repr__(self) -> str:
        return f"ControlClient({self.base_url!r})"  # never the token

    async def __aenter__(self) -> ControlClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def _open(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("control client is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=_connector(*self._limits))
        return self._session

    async def status(self) -> dict[str, Any]:
        return await self._request("GET", "status", None, self._timeout_s, None)

    async def status_fresh(self, *, processes: bool = False) -> dict[str, Any]:
        """Status over a connection of its own (never a pooled one), so that on
        a port several processes accept on, each probe may reach another.
        `processes`: ask which processes accept on the port (the reply's
        `accepting_processes`)."""
        url = f"{self.base_url}{CHECKPOINT_ROUTE_PREFIX}/status"
        if processes:
            url += f"?{PROCESSES_QUERY}=1"
        connector = aiohttp.TCPConnector(force_close=True)
        try:
            async with (
                aiohttp.ClientSession(connector=connector) as session,
                session.get(
                    url, headers=self._headers, timeout=aiohttp.ClientTimeout(self._timeout_s)
                ) as resp,
            ):
                status, raw = resp.status, await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise ParticipantUnavailable(f"status of {self.base_url} failed: {exc!r}") from None
        return _reply("status", self.base_url, status, raw)

    async def call(self, op: str, body: Mapping[str, Any] | msgspec.Struct) -> dict[str, Any]:
        """POST one control operation; the reply as plain builtins."""
        if op not in CONTROL_OPERATIONS:
            raise InvalidRequest(f"unknown control operation {op!r}")
        deadline = (
            body.get("deadline_ts")
            if isinstance(body, Mapping)
            else getattr(body, "deadline_ts", None)
        )
        if isinstance(deadline, int | float) and not isinstance(deadline, bool):
            timeout = max(deadline - self._clock.now(), 0.0) + self._grace_s
        else:
            deadline, timeout = None, self._timeout_s
        return await self._request("POST", op, _encode(body), timeout, deadline)

    async def _request(
        self,
        method: str,
        op: str,
        data: bytes | None,
        timeout_s: float,
        deadline: float | None,
    ) -> dict[str, Any]:
        url = f"{self.base_url}{CHECKPOINT_ROUTE_PREFIX}/{op}"
        headers = dict(self._headers)
        tracing.inject(headers)  # the caller's span, continued by the participant
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with self._open().request(
                method,
                url,
                data=data,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                status, raw = resp.status, await resp.read()
        except TimeoutError:
            if deadline is not None:
                raise DeadlineExceeded(
                    f"{op} to {self.base_url} got no reply within its deadline"
                ) from None
            raise ParticipantUnavailable(
                f"{op} to {self.base_url} got no reply in {timeout_s:.1f}s"
            ) from None
        except aiohttp.ClientError as exc:
            raise ParticipantUnavailable(f"{op} to {self.base_url} failed: {exc!r}") from None
        return _reply(op, self.base_url, status, raw)


def _reply(op: str, where: str, status: int, raw: bytes) -> dict[str, Any]:
    try:
        body: Any = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        body = raw[:200].decode("utf-8", "replace")
    if 200 <= status < 300:
        if isinstance(body, dict):
            return body
        raise ParticipantUnavailable(f"{op} to {where}: reply is not a JSON object: {body!r}")
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("code") in _KNOWN_CODES:
        if error["code"] == Reason.COORDINATION_FAILED.value:
            raise CoordinationFailed(
                str(error.get("detail", "")),
                operation=str(error.get("operation", "")),
                failures=error.get("failures") or {},
            )
        raise error_from_body(status, body)
    validation = validation_error(status, body)
    if validation is not None:
        raise validation
    # No error we know: a plain server, a proxy, or a crash (`internal`) answered.
    detail = f"{op} to {where}: HTTP {status}: {body!r}"[:500]
    if status == 404:
        raise NotFound(detail)  # discovery: not a participant
    if status == 401:
        raise Unauthorized(detail)
    if status >= 500:
        raise ParticipantUnavailable(detail)
    raise CheckpointError(detail)
