"""The agent participant: sessions parked at turn boundaries.

An agent session (one per episode attempt, keyed by its capture key) outlives
the activations that drive it: the environment invokes one activation per
episode step, and each activation runs model → tool rounds.  The session's
state at its last boundary is a JSON snapshot (conversation, turn, results),
recorded before each model call and after each tool round (reference notes
§2.2):

- a live activation is an `EpisodeSteps` episode whose boundary is the
  snapshot; its model calls are replay steps (an agent waiting on the policy
  model counts as at its boundary, because the model holds the response) and
  its tool calls are wait steps (a tool call is not safe to run twice);
- a session between activations is exported from the session table.

A restore installs each snapshot under attempt + 1, and the next activation
of that attempt continues from it.  New activations wait for resume rather
than being refused: the environment calls the agent from a replay step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from participants.hooks import stage_records
from ray_ckpt.clock import SYSTEM_CLOCK, Clock
from ray_ckpt.control.admission import AdmissionGate
from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import PrepareReport
from ray_ckpt.steps import EpisodeSteps
from ray_ckpt.steps.retire_marks import retire_scope
from ray_ckpt.storage.records.record import Record, check_json

SESSION_FIELDS = frozenset({"step", "turn", "done", "messages", "turns", "result"})


def check_session(state: Any, where: str) -> dict[str, Any]:
    if not isinstance(state, dict) or not state.keys() >= SESSION_FIELDS:
        raise InvalidCheckpointState(f"agent session {where}: needs {sorted(SESSION_FIELDS)}")
    if not isinstance(state["messages"], list) or not isinstance(state["turns"], list):
        raise InvalidCheckpointState(f"agent session {where}: messages and turns are lists")
    return state


class AgentParticipant:
    kind = "agent"

    def __init__(self, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.steps = EpisodeSteps(clock=clock)
        self.sessions: dict[EpisodeId, dict[str, Any]] = {}  # between activations
        self.restored: set[EpisodeId] = set()  # installed, not activated yet
        self._installed = False
        self.gate = AdmissionGate()
        self._notify: Callable[[], None] = lambda: None

    # --- engine side -----------------------------------------------------
    def bind(self, notify: Callable[[], None]) -> None:
        self._notify = notify
        self.steps.bind(notify)

    def close_admission(self) -> None:
        self.gate.close()
        self.steps.close_admission()

    def open_admission(self) -> None:
        self.gate.open()
        self.steps.open_admission()

    def ready(self) -> bool:
        return self.steps.ready()

    def report(self, limit: int) -> PrepareReport:
        report = self.steps.report(limit)
        counts = {**report.counts, "sessions": self.session_count(), "restored": len(self.restored)}
        return PrepareReport(
            ready=report.ready,
            blockers=report.blockers,
            blocker_count=report.blocker_count,
            counts=counts,
            restarts=report.restarts,
        )

    def live_executions(self) -> int:
        return self.steps.live_executions()

    def live_keys(self) -> list[str]:
        return [e.key for e in self.steps.episodes()]

    def retiring(self) -> int:
        # The attempts being stopped right now (`status.retiring`): a stop
        # outlives a retire call that gave up, so the engine's count of
        # calls in flight would undercount.
        return self.steps.retiring()

    def fresh(self) -> bool:
        return self.steps.fresh() and not self.sessions and not self._installed

    async def export(self, scope: Sequence[EpisodeId] | None) -> list[Record]:
        # Live activations export their boundary (and must be at one).
        live = {r.key: r.state["boundary"] for r in self.steps.export(scope)}
        keys = [e.capture_key for e in (self.sessions if scope is None else scope)]
        records = dict(live)
        for key in keys:
            episode = EpisodeId.from_capture_key(key)
            if key not in records and episode in self.sessions:
                records[key] = check_json(self.sessions[episode], episode=key)
        return [Record(key, {"session": state}) for key, state in sorted(records.items())]

    async def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        if not self.fresh():
            raise InvalidCheckpointState("an agent restores only into a fresh process")

        def parse(record: Record) -> dict[str, Any]:
            if not isinstance(record.state, dict):
                raise InvalidCheckpointState(f"agent record {record.key}: not an object")
            return check_session(record.state.get("session"), record.key)

        staged = stage_records(records, parse)
        self.sessions.update(staged)
        self.restored.update(staged)
        self._installed = True
        self._notify()
        return list(staged)

    async def retire(self, episode_ids: Sequence[EpisodeId]) -> list[str]:
        keys = set(await self.steps.retire(episode_ids))
        covered = retire_scope(episode_ids)
        # After the activations stopped: their cleanup may have saved a snapshot.
        for episode in [e for e in self.sessions if covered(e)]:
            del self.sessions[episode]
            self.restored.discard(episode)
            keys.add(episode.capture_key)
        self._notify()
        return sorted(keys)

    async def delete_restored(self, keep: Sequence[EpisodeId]) -> list[str]:
        kept = set(keep)
        freed = sorted(e for e in self.restored if e not in kept)
        for episode in freed:
            self.restored.discard(episode)
            self.sessions.pop(episode, None)
        return [e.capture_key for e in freed]

    def session_count(self) -> int:
        """Sessions held: between activations, or inside a live one."""
        return len(self.sessions.keys() | {ep.id for ep in self.steps.episodes()})

    # --- data plane ----------------------------------------------------------
    async def wait_open(self) -> None:
        await self.gate.wait_open()

    def session(self, episode: EpisodeId) -> dict[str, Any] | None:
        self.restored.discard(episode)
        return self.sessions.get(episode)

    def save(self, episode: EpisodeId, snapshot: Any) -> None:
        self.sessions[episode] = snapshot

    def close(self, episode: EpisodeId) -> bool:
        self.restored.discard(episode)
        return self.sessions.pop(episode, None) is not None
