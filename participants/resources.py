"""The resources participant: per-session state behind async session hooks.

A resources server (tools, a game, a sandbox) holds one state per episode
session, keyed by the episode's capture key (reference notes §2.3):

- **exported**: states leave and return through `SessionHooks`
  (`export_session_states`, `restore_session_states` — validate everything,
  then install — and the idempotent `retire_session_state`).
- **stateless**: a pure verifier; declares replayable verification and
  exports nothing.
- **restart_only**: the default, failing closed for servers nobody audited.
  It exports nothing, never blocks, reports every live session as a restart
  (and says so with `x-ng-checkpoint-restart: 1` on its seed reply).

Requests that arrive while a checkpoint is open wait for resume instead of
being refused (a refusal would surface to the model as a tool error).  Prepare
is ready once no counted request is in flight; a replayable `/verify` is not
counted.  Retire cancels the attempt's requests, waits, then frees its state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import Any, Protocol

from participants.hooks import stage_records, stop_tasks
from ray_ckpt.control.admission import AdmissionGate
from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import Blocker, PrepareReport
from ray_ckpt.steps.retire_marks import retire_scope
from ray_ckpt.storage.records.record import Record, check_json


class ResourcesMode(StrEnum):
    EXPORTED = "exported"
    STATELESS = "stateless"
    RESTART_ONLY = "restart_only"


class SessionHooks(Protocol):
    """How a resources server's own session states leave and return."""

    async def export_session_states(self, keys: Sequence[EpisodeId]) -> dict[EpisodeId, Any]: ...

    async def restore_session_states(self, states: Mapping[EpisodeId, Any]) -> None:
        """Validate every state, then install them all (never a partial set)."""
        ...

    async def retire_session_state(self, key: EpisodeId) -> None:
        """Free one session's state; idempotent."""
        ...


def stage_sessions(records: Sequence[Record]) -> dict[EpisodeId, Any]:
    """Validate exported-session records: their states keyed by attempt + 1."""

    def parse(record: Record) -> Any:
        if not isinstance(record.state, dict) or "session" not in record.state:
            raise InvalidCheckpointState(f"session {record.key}: record needs a 'session'")
        return record.state["session"]

    return stage_records(records, parse)


class _Request:
    __slots__ = ("counted", "episode", "route", "task")

    def __init__(self, episode: EpisodeId, route: str, counted: bool, task: Any) -> None:
        self.episode = episode
        self.route = route
        self.counted = counted
        self.task: asyncio.Task[Any] | None = task


class ResourcesParticipant:
    kind = "resources"

    def __init__(
        self, hooks: SessionHooks, *, mode: ResourcesMode | str = ResourcesMode.RESTART_ONLY
    ) -> None:
        self.hooks = hooks
        self.mode = ResourcesMode(mode)
        self.sessions: set[EpisodeId] = set()
        self.restored: set[EpisodeId] = set()  # installed, not touched yet
        self._inflight: dict[int, _Request] = {}
        self._next = 0
        self.gate = AdmissionGate()
        self._served = False
        self._installed = False
        self._notify: Callable[[], None] = lambda: None

    # --- engine side -----------------------------------------------------
    def bind(self, notify: Callable[[], None]) -> None:
        self._notify = notify

    def close_admission(self) -> None:
        self.gate.close()
        self._notify()

    def open_admission(self) -> None:
        self.gate.open()
        self._notify()

    def _blocking(self) -> list[_Request]:
        if self.mode is ResourcesMode.RESTART_ONLY:
            return []
        return [r for r in self._inflight.values() if r.counted]

    def busy(self) -> set[EpisodeId]:
        """The sessions a counted request runs in now (not at their boundary)."""
        return {r.episode for r in self._inflight.values() if r.counted}

    def ready(self) -> bool:
        return not self._blocking()

    def report(self, limit: int) -> PrepareReport:
        blocking = sorted(self._blocking(), key=lambda r: r.episode.capture_key)
        restarts = (
            sorted(e.capture_key for e in self.sessions)
            if self.mode is ResourcesMode.RESTART_ONLY
            else []
        )
        return PrepareReport(
            ready=not blocking,
            blockers=[
                Blocker(key=r.episode.capture_key, state="running", detail=r.route)
                for r in blocking[: max(limit, 0)]
            ],
            blocker_count=len(blocking),
            counts={
                "sessions": len(self.sessions),
                "inflight": len(self._inflight),
                "restored": len(self.restored),
            },
            restarts=restarts,
        )

    def live_executions(self) -> int:
        return len(self._inflight)

    def live_keys(self) -> list[str]:
        return sorted({r.episode.capture_key for r in self._inflight.values()})

    def fresh(self) -> bool:
        return not self._served and not self._installed

    async def export(self, scope: Sequence[EpisodeId] | None) -> list[Record]:
        if self.mode is not ResourcesMode.EXPORTED:
            return []
        keys = sorted(self.sessions if scope is None else set(scope) & self.sessions)
        states = await self.hooks.export_session_states(keys)
        return [
            Record(e.capture_key, {"session": check_json(states[e], episode=e.capture_key)})
            for e in keys
            if e in states
        ]

    async def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        if self.mode is not ResourcesMode.EXPORTED:
            if records:
                raise InvalidCheckpointState(
                    f"a {self.mode.value} resources server exports nothing"
                )
            self._installed = True
            return []

        staged = stage_sessions(records)
        await self.hooks.restore_session_states(staged)
        self.sessions.update(staged)
        self.restored.update(staged)
        self._installed = True
        self._notify()
        return list(staged)

    async def retire(self, episode_ids: Sequence[EpisodeId]) -> list[str]:
        covered = retire_scope(episode_ids)

        stopping = [r for r in self._inflight.values() if covered(r.episode)]
        keys = {r.episode.capture_key for r in stopping}
        await stop_tasks(r.task for r in stopping)
        for episode in sorted(e for e in self.sessions if covered(e)):
            await self.hooks.retire_session_state(episode)
            self.sessions.discard(episode)
            self.restored.discard(episode)
            keys.add(episode.capture_key)
        self._notify()
        return sorted(keys)

    async def delete_restored(self, keep: Sequence[EpisodeId]) -> list[str]:
        kept = set(keep)
        freed = sorted(e for e in self.restored if e not in kept)
        for episode in freed:
            await self.hooks.retire_session_state(episode)
            self.sessions.discard(episode)
            self.restored.discard(episode)
        return [e.capture_key for e in freed]

    # --- data plane ----------------------------------------------------------
    async def enter(self, episode: EpisodeId, route: str, *, counted: bool = True) -> int:
        """Admit one request, waiting out an open checkpoint; returns its ticket."""
        await self.gate.wait_open()
        self._served = True
        self.restored.discard(episode)
        ticket = self._next
        self._next += 1
        self._inflight[ticket] = _Request(episode, route, counted, asyncio.current_task())
        self._notify()
        return ticket

    def inflight_routes(self) -> dict[str, int]:
        routes: dict[str, int] = {}
        for req in self._inflight.values():
            routes[req.route] = routes.get(req.route, 0) + 1
        return routes

    def leave(self, ticket: int) -> None:
        if self._inflight.pop(ticket, None) is not None:
            self._notify()

    def bind_session(self, episode: EpisodeId) -> None:
        self.sessions.add(episode)

    async def end_session(self, episode: EpisodeId) -> bool:
        known = episode in self.sessions
        await self.hooks.retire_session_state(episode)
        self.sessions.discard(episode)
        self.restored.discard(episode)
        return known
