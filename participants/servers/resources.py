"""The reference resources server: a seeded number-guessing game per session.

Routes (each under the rollout path prefix `/ng-rollout/<key>/`):

- `POST seed_session` `{"task_id", "seed"}` creates the session (a secret in
  [0, 100) drawn from the seed) and answers `{"observation"}` with the
  `x-ng-checkpoint-verify` header (and `x-ng-checkpoint-restart: 1` for a
  restart-only server).  Seeding again replaces the session (a replayed seed).
- `POST guess` `{"value"}` and `POST hint` `{}` mutate it and answer the
  feedback plus the session's state after the move (a stateless verifier's
  tools are pure functions of their arguments).
- `POST verify` scores it: `{"reward", "solved", "guesses", "hints"}`.  Pure:
  running it twice gives the same answer.  A stateless verifier scores the
  body instead: `{"seed", "final"}`.
- `POST close_session` frees it (never refused, idempotent).

Each tool call takes `step_delay_s`, each verify `verify_delay_s`, so a
checkpoint can land mid-call.  `GET /stats` reports calls, verifications,
live sessions and in-flight requests.
"""

from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web

from participants.common import ServerBase, episode_of, guarded, json_object, want_int, want_str
from participants.resources import ResourcesMode, ResourcesParticipant
from ray_ckpt.errors import InvalidCheckpointState, NotFound
from ray_ckpt.identity import EpisodeId
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.steps import StepMode, seed_session_headers, step_mode

_GAME_FIELDS = ("task_id", "secret", "guesses", "hints", "solved")


def secret_for(seed: int) -> int:
    return random.Random(seed).randrange(100)


class GuessGame:
    """Session states and their hooks (the `SessionHooks` of this server)."""

    def __init__(self) -> None:
        self.states: dict[EpisodeId, dict[str, Any]] = {}

    def seed(self, episode: EpisodeId, task_id: str, seed: int) -> str:
        # Key order is part of the state: tool replies render it back verbatim.
        self.states[episode] = {
            "task_id": task_id,
            "secret": secret_for(seed),
            "guesses": [],
            "hints": 0,
            "solved": False,
        }
        return f"{task_id}: guess a number between 0 and 99"

    def get(self, episode: EpisodeId) -> dict[str, Any]:
        state = self.states.get(episode)
        if state is None:
            raise NotFound(f"no session for {episode}")
        return state

    def move(self, episode: EpisodeId, tool: str, args: Mapping[str, Any]) -> dict[str, Any]:
        state = self.get(episode)
        if tool == "guess":
            value = want_int(args, "value", high=99)
            state["guesses"].append(value)
            if value == state["secret"]:
                state["solved"] = True
            feedback = (
                "correct"
                if value == state["secret"]
                else ("higher" if value < state["secret"] else "lower")
            )
            reply: dict[str, Any] = {"feedback": feedback}
        else:
            state["hints"] += 1
            reply = {"feedback": "odd" if state["secret"] % 2 else "even"}
        public = {k: v for k, v in state.items() if k != "secret"}
        return {**reply, "state": copy.deepcopy(public)}

    def score(self, episode: EpisodeId) -> dict[str, Any]:
        state = self.get(episode)
        return score(state["secret"], state["guesses"], state["hints"], state["solved"])

    async def export_session_states(self, keys: Sequence[EpisodeId]) -> dict[EpisodeId, Any]:
        return {k: copy.deepcopy(self.states[k]) for k in keys if k in self.states}

    async def restore_session_states(self, states: Mapping[EpisodeId, Any]) -> None:
        for key, state in states.items():
            if not isinstance(state, dict) or tuple(state) != _GAME_FIELDS:
                raise InvalidCheckpointState(f"session {key}: not a guess-game state")
        for key, state in states.items():
            self.states[key] = copy.deepcopy(state)

    async def retire_session_state(self, key: EpisodeId) -> None:
        self.states.pop(key, None)


def score(secret: int, guesses: list[int], hints: int, solved: bool) -> dict[str, Any]:
    best = min((abs(g - secret) for g in guesses), default=100)
    reward = 1.0 if solved else round(max(0.0, 1.0 - best / 100) - 0.01 * hints, 4)
    return {"reward": reward, "solved": solved, "guesses": len(guesses), "hints": hints}


def pure_tool(name: str, args: Mapping[str, Any]) -> dict[str, Any]:
    if name == "guess":
        value = want_int(args, "value", high=99)
        return {"feedback": "recorded", "state": {"last": value}}
    return {"feedback": "no hints from a stateless verifier", "state": {}}


class ResourcesServer(ServerBase):
    kind = "resources"

    def __init__(
        self,
        name: str,
        *,
        mode: ResourcesMode | str = ResourcesMode.EXPORTED,
        verify_mode: str = "wait",
        step_delay_s: float = 0.0,
        verify_delay_s: float | None = None,
    ) -> None:
        super().__init__(name)
        self.game = GuessGame()
        self.participant = ResourcesParticipant(self.game, mode=mode)
        self.mode = self.participant.mode
        # A stateless verifier is pure by construction: its verify may replay.
        self.verify_mode = (
            StepMode.REPLAY if self.mode is ResourcesMode.STATELESS else step_mode(verify_mode)
        )
        self.step_delay_s = step_delay_s
        self.verify_delay_s = step_delay_s if verify_delay_s is None else verify_delay_s
        self.verifications = 0

    def app(self) -> web.Application:
        app = web.Application()
        prefix = "/ng-rollout/{key}"
        app.router.add_post(f"{prefix}/seed_session", guarded(self.seed_session))
        app.router.add_post(f"{prefix}/verify", guarded(self.verify))
        app.router.add_post(f"{prefix}/close_session", guarded(self.close_session))
        app.router.add_post(f"{prefix}/{{tool:guess|hint}}", guarded(self.tool))
        app.router.add_get("/stats", self.stats_route)
        return app

    async def _enter(self, request: web.Request, route: str, *, counted: bool = True) -> Any:
        self.calls[route] += 1
        episode = episode_of(request)
        self.check_attempt(episode)
        body = await json_object(request)
        ticket = await self.participant.enter(episode, route, counted=counted)
        # It may have been retired while it waited for resume.
        try:
            self.check_attempt(episode)
        except BaseException:
            self.participant.leave(ticket)
            raise
        return episode, body, ticket

    async def seed_session(self, request: web.Request) -> web.Response:
        episode, body, ticket = await self._enter(request, "seed_session")
        try:
            task_id, seed = want_str(body, "task_id"), want_int(body, "seed")
            if self.mode is ResourcesMode.STATELESS:
                observation = f"{task_id}: guess a number between 0 and 99"
            else:
                observation = self.game.seed(episode, task_id, seed)
                self.participant.bind_session(episode)
        finally:
            self.participant.leave(ticket)
        headers = seed_session_headers(
            verify=self.verify_mode, restart=self.mode is ResourcesMode.RESTART_ONLY
        )
        return web.json_response({"observation": observation}, headers=headers)

    async def tool(self, request: web.Request) -> web.Response:
        name = request.match_info["tool"]
        episode, body, ticket = await self._enter(request, name)
        try:
            if self.mode is ResourcesMode.STATELESS:
                # No session: a pure tool whose answer depends on its arguments only.
                return web.json_response(pure_tool(name, body))
            self.game.get(episode)  # unknown session: 404 before any delay
            if self.step_delay_s > 0:
                await asyncio.sleep(self.step_delay_s)
            # The move happens after the delay: a cancelled call changes nothing.
            reply = self.game.move(episode, name, body)
        finally:
            self.participant.leave(ticket)
        return web.json_response(reply)

    async def verify(self, request: web.Request) -> web.Response:
        replayable = self.verify_mode is StepMode.REPLAY
        episode, body, ticket = await self._enter(request, "verify", counted=not replayable)
        try:
            if self.mode is ResourcesMode.STATELESS:
                seed = want_int(body, "seed")
                final = body.get("final")
                guesses = [final] if isinstance(final, int) and not isinstance(final, bool) else []
                secret = secret_for(seed)
                scored = score(secret, guesses, 0, secret in guesses)
            else:
                self.game.get(episode)
                if self.verify_delay_s > 0:
                    await asyncio.sleep(self.verify_delay_s)
                scored = self.game.score(episode)
            self.verifications += 1
        finally:
            self.participant.leave(ticket)
        return web.json_response(scored)

    async def close_session(self, request: web.Request) -> web.Response:
        # Never refused and never waits: closing only frees.
        self.calls["close_session"] += 1
        episode = episode_of(request)
        return web.json_response({"closed": await self.participant.end_session(episode)})

    def stats(self) -> dict[str, Any]:
        return {
            **self.base_stats(),
            "mode": self.mode.value,
            "verify_mode": self.verify_mode.value,
            "verifications": self.verifications,
            "sessions": len(self.game.states),
            "tracked_sessions": len(self.participant.sessions),
            "inflight": self.participant.live_executions(),
            "inflight_by_route": self.participant.inflight_routes(),
        }


def resources_server(
    *,
    name: str,
    settings: CheckpointSettings,
    mode: str = "exported",
    verify_mode: str = "wait",
    step_delay_s: float = 0.0,
    verify_delay_s: float | None = None,
) -> ResourcesServer:
    return ResourcesServer(
        name,
        mode=mode,
        verify_mode=verify_mode,
        step_delay_s=step_delay_s,
        verify_delay_s=verify_delay_s,
    )
