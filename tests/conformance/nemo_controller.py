"""A NeMo Gym-shaped controller: its coordination call patterns as the notes describe them.

Written from `gym-protocol-notes.md` (§1.11, §1.12, §1.15, §1.18) only; NeMo
Gym's code is not available to us and is never copied.  Stateless, as its
`coordination` module is: every function takes the members and an ID, and
every call can be retried with the same ID.

- `discover`: GET status on each URL (3 tries); 404 = not a participant; any
  other failure, an unknown kind, or no `model` participant raises; members
  sorted by stage, then name.
- `prepare`: `PREPARE_ORDER`, one stage at a time, stopping at the first
  stage that is not prepared.  `commit`/`restore`: every member concurrently.
  `resume`: reverse stage order, continuing past failures.
- `retire`/`forget`: `RETIRE_ORDER`, callers before callees.
- `retire_stragglers`: resume (abort), then retire every blocker string
  (turned back into an episode by `from_capture_key`) under the same ID.
- `restore`: all or nothing; on failure retire `next_attempt(e)` everywhere
  (deadline `max(deadline, now + 30)`), then resume everywhere, then re-raise.
- The collection's constants: retire under `retire`, forget under `forget`,
  checkpoints into `<root>/<checkpoint_id>`, restore IDs `restore-<hex>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

PREFIX = "/ng-control/v1/checkpoint"
PREPARE_ORDER = ("environment", "model", "agent", "resources")
RETIRE_ORDER: tuple[tuple[str, ...], ...] = (("environment",), ("agent",), ("model", "resources"))
RETIRE_ID = "retire"
FORGET_ID = "forget"
POST_GRACE_S = 5.0
DISCOVERY_TRIES = 3
DISCOVERY_TIMEOUT_S = 60.0
CLEANUP_MIN_S = 30.0
_SUFFIX = re.compile(r"-a([1-9][0-9]*)$")


class CoordinationError(Exception):
    """One operation failed at some servers: per server, the `{"error": {...}}` they sent."""

    def __init__(self, operation: str, failures: Mapping[str, Any]) -> None:
        super().__init__(f"{operation} failed at {sorted(failures)}: {dict(failures)}")
        self.operation = operation
        self.failures = dict(failures)


def from_capture_key(key: str) -> dict[str, Any]:
    """`r` → attempt 0, `r-a2` → attempt 2 (the reserved suffix makes it one-to-one)."""
    if not isinstance(key, str):
        raise TypeError(f"a blocker is a capture-key string, got {key!r}")
    m = _SUFFIX.search(key)
    if m is None:
        return {"rollout_id": key, "attempt": 0}
    return {"rollout_id": key[: m.start()], "attempt": int(m.group(1))}


def capture_key(e: Mapping[str, Any]) -> str:
    attempt = int(e.get("attempt", 0))
    return str(e["rollout_id"]) if attempt == 0 else f"{e['rollout_id']}-a{attempt}"


def next_attempt(e: Mapping[str, Any]) -> dict[str, Any]:
    return {"rollout_id": e["rollout_id"], "attempt": int(e.get("attempt", 0)) + 1}


def checkpoint_dir(root: str | Path, checkpoint_id: str) -> str:
    return str(Path(root) / checkpoint_id)


def restore_id() -> str:
    return f"restore-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Member:
    name: str
    url: str
    kind: str


@dataclass
class PrepareResult:
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def prepared(self) -> bool:
        return bool(self.replies) and all(
            r.get("phase") == "prepared" for r in self.replies.values()
        )

    def blockers(self) -> dict[str, list[str]]:
        return {
            name: list(r.get("report", {}).get("blockers", []))
            for name, r in self.replies.items()
            if r.get("phase") != "prepared"
        }

    def restarts(self) -> set[str]:
        return {k for r in self.replies.values() for k in r.get("report", {}).get("restarts", [])}

    def continued(self, in_flight: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        gone = self.restarts()
        return [dict(e) for e in in_flight if capture_key(e) not in gone]


class Controller:
    """The calls, over one aiohttp session with a bearer token."""

    def __init__(self, session: aiohttp.ClientSession, token: str) -> None:
        self.session = session
        self.headers = {"Authorization": f"Bearer {token}"}

    # --- transport ---------------------------------------------------------------
    async def _status(self, url: str) -> tuple[int, Any]:
        last: Exception | None = None
        for _ in range(DISCOVERY_TRIES):
            try:
                async with self.session.get(
                    f"{url}{PREFIX}/status",
                    headers=self.headers,
                    timeout=aiohttp.ClientTimeout(total=DISCOVERY_TIMEOUT_S),
                ) as resp:
                    body = await resp.json(content_type=None) if resp.status != 404 else None
                    return resp.status, body
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = exc
        raise CoordinationError("discover", {url: repr(last)})

    async def _post(self, m: Member, op: str, body: Mapping[str, Any]) -> dict[str, Any]:
        timeout = max(float(body["deadline_ts"]) - time.time(), 0.0) + POST_GRACE_S
        async with self.session.post(
            f"{m.url}{PREFIX}/{op}",
            json=dict(body),
            headers=self.headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            reply = await resp.json(content_type=None)
            if resp.status >= 400:
                raise CoordinationError(op, {m.name: _error_of(resp.status, reply)})
            if not isinstance(reply, dict):
                raise CoordinationError(op, {m.name: {"code": "bad_reply", "detail": reply}})
            return reply

    async def _fan(
        self, members: Sequence[Member], op: str, body: Mapping[str, Any]
    ) -> dict[str, dict[str, Any]]:
        """All at once; raises with every failure once all have answered."""
        results = await asyncio.gather(
            *(self._post(m, op, body) for m in members), return_exceptions=True
        )
        failures: dict[str, Any] = {}
        replies: dict[str, dict[str, Any]] = {}
        for m, r in zip(members, results, strict=True):
            if isinstance(r, CoordinationError):
                failures.update(r.failures)
            elif isinstance(r, BaseException):
                failures[m.name] = {"code": "unreachable", "detail": repr(r)}
            else:
                replies[m.name] = r
        if failures:
            raise CoordinationError(op, failures)
        return replies

    # --- discovery -----------------------------------------------------------------
    async def discover(self, servers: Mapping[str, str]) -> list[Member]:
        members: list[Member] = []
        for name, url in servers.items():
            status, body = await self._status(url.rstrip("/"))
            if status == 404:
                continue  # not a participant (a judge model, a relay)
            if status != 200 or not isinstance(body, dict):
                raise CoordinationError("discover", {name: _error_of(status, body)})
            kind = body.get("kind")
            if kind not in PREPARE_ORDER:
                raise CoordinationError("discover", {name: f"unknown participant kind {kind!r}"})
            members.append(Member(name, url.rstrip("/"), str(kind)))
        if not any(m.kind == "model" for m in members):
            raise CoordinationError("discover", {"*": "no policy model participates"})
        return sorted(members, key=lambda m: (PREPARE_ORDER.index(m.kind), m.name))

    # --- the phases --------------------------------------------------------------
    async def prepare(
        self, members: Sequence[Member], cid: str, deadline_ts: float
    ) -> PrepareResult:
        result = PrepareResult()
        body = {"checkpoint_id": cid, "deadline_ts": deadline_ts}
        for kind in PREPARE_ORDER:
            stage = [m for m in members if m.kind == kind]
            if not stage:
                continue
            result.replies.update(await self._fan(stage, "prepare", body))
            if not all(result.replies[m.name].get("phase") == "prepared" for m in stage):
                break  # later stages would see work the unprepared one still sends
        return result

    async def renew(self, members: Sequence[Member], cid: str, deadline_ts: float) -> None:
        await self._fan(members, "renew", {"checkpoint_id": cid, "deadline_ts": deadline_ts})

    async def commit(
        self,
        members: Sequence[Member],
        cid: str,
        deadline_ts: float,
        directory: str,
        episode_ids: Sequence[Mapping[str, Any]] | None,
        *,
        stop: bool = False,
    ) -> dict[str, dict[str, Any]]:
        body = {
            "checkpoint_id": cid,
            "deadline_ts": deadline_ts,
            "checkpoint_dir": directory,
            "episode_ids": None if episode_ids is None else [dict(e) for e in episode_ids],
            "stop": stop,
        }
        return await self._fan(members, "commit", body)

    async def resume(
        self, members: Sequence[Member], cid: str, deadline_ts: float
    ) -> dict[str, Any]:
        """Reverse order, past failures (an unreachable one resumes when its lease lapses)."""
        failures: dict[str, Any] = {}
        body = {"checkpoint_id": cid, "deadline_ts": deadline_ts}
        for kind in reversed(PREPARE_ORDER):
            stage = [m for m in members if m.kind == kind]
            try:
                await self._fan(stage, "resume", body)
            except CoordinationError as exc:
                failures.update(exc.failures)
        return failures

    async def _in_retire_order(
        self, members: Sequence[Member], op: str, body: Mapping[str, Any]
    ) -> dict[str, dict[str, Any]]:
        replies: dict[str, dict[str, Any]] = {}
        for kinds in RETIRE_ORDER:
            stage = [m for m in members if m.kind in kinds]
            if stage:
                replies.update(await self._fan(stage, op, body))
        return replies

    async def retire(
        self,
        members: Sequence[Member],
        cid: str,
        deadline_ts: float,
        episode_ids: Sequence[Mapping[str, Any]],
    ) -> dict[str, dict[str, Any]]:
        body = {
            "checkpoint_id": cid,
            "deadline_ts": deadline_ts,
            "episode_ids": [dict(e) for e in episode_ids],
        }
        return await self._in_retire_order(members, "retire", body)

    async def forget(
        self, members: Sequence[Member], cid: str, deadline_ts: float, rollout_ids: Sequence[str]
    ) -> dict[str, dict[str, Any]]:
        body = {"checkpoint_id": cid, "deadline_ts": deadline_ts, "rollout_ids": list(rollout_ids)}
        return await self._in_retire_order(members, "forget", body)

    async def retire_stragglers(
        self, members: Sequence[Member], cid: str, result: PrepareResult, deadline_ts: float
    ) -> list[dict[str, Any]]:
        """The documented straggler path: abort, then retire the blockers under the same ID."""
        await self.resume(members, cid, deadline_ts)
        episodes = [from_capture_key(k) for keys in result.blockers().values() for k in keys]
        if episodes:
            await self.retire(members, cid, deadline_ts, episodes)
        return episodes

    async def restore(
        self,
        members: Sequence[Member],
        cid: str,
        deadline_ts: float,
        directory: str,
        episode_ids: Sequence[Mapping[str, Any]],
    ) -> dict[str, dict[str, Any]]:
        body = {
            "checkpoint_id": cid,
            "deadline_ts": deadline_ts,
            "checkpoint_dir": directory,
            "episode_ids": [dict(e) for e in episode_ids],
        }
        try:
            return await self._fan(members, "restore", body)
        except CoordinationError:
            cleanup_ts = max(deadline_ts, time.time() + CLEANUP_MIN_S)
            nexts = [next_attempt(e) for e in episode_ids]
            await _quietly(self.retire(members, cid, cleanup_ts, nexts))
            await self.resume(members, cid, cleanup_ts)
            raise


async def _quietly(call: Awaitable[Any]) -> None:
    with contextlib.suppress(CoordinationError):  # resume must still run everywhere
        await call


def _error_of(status: int, body: Any) -> Any:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return {"status": status, **error}
    return {"status": status, "code": "http_error", "detail": body}
