"""The reference agent: a Simple-Agent-style loop, one activation per episode step.

`POST /ng-rollout/<key>/activate` `{"step": i, "observation": str}` runs step
`i` of the session: `turns_per_step` rounds of model call (the policy model's
`/v1/responses`, retried while it answers `admission_closed`) → parse the
function call → tool call on the resources server → feed the result back.  It
answers `{"result": {"step", "turns": [...]}}`; each turn holds the model's
tokens and text, the tool call and the tool's reply.

Activations are idempotent per step: a session that already finished step `i`
answers its stored result, and a restored session in the middle of step `i`
continues from its last turn boundary.  `POST /ng-rollout/<key>/close` frees
the session (never refused) and closes the attempt at the policy model too, so
the model frees its ledger rows.  `GET /stats` reports calls, model and tool
calls made, activations and live sessions.

Each model call says its position in the session (`x-ng-model-call`: the
number of model calls the session made before it).  A response that arrives
after the agent exported the boundary before the call is dropped with the
process; the restored session re-issues the call at the same position, and the
model replaces that row instead of adding one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from participants.agent import AgentParticipant, check_session
from participants.common import (
    MODEL_CALL_HEADER,
    ServerBase,
    episode_of,
    guarded,
    json_object,
    want_int,
    want_str,
)
from ray_ckpt.errors import (
    AdmissionClosed,
    CheckpointError,
    InvalidRequest,
    NotFound,
    ParticipantUnavailable,
)
from ray_ckpt.identity import EpisodeId, rollout_path
from ray_ckpt.settings import CheckpointSettings

TOOLS = [
    {
        "type": "function",
        "name": "guess",
        "description": "Guess the secret number.",
        "parameters": {"type": "object", "properties": {"value": {"type": "integer"}}},
    },
    {
        "type": "function",
        "name": "hint",
        "description": "Learn whether the secret is odd or even.",
        "parameters": {"type": "object", "properties": {}},
    },
]
SYSTEM = "You are playing a guessing game. Use the tools."


def new_step(previous: dict[str, Any] | None, step: int, observation: str) -> dict[str, Any]:
    messages = (
        previous["messages"] if previous is not None else [{"role": "system", "content": SYSTEM}]
    )
    return {
        "step": step,
        "turn": 0,
        "done": False,
        "messages": [*messages, {"role": "user", "content": observation}],
        "turns": [],
        "result": None,
    }


class AgentServer(ServerBase):
    kind = "agent"

    def __init__(
        self,
        name: str,
        *,
        model_url: str,
        resources_url: str,
        turns_per_step: int = 2,
        tokens_per_turn: int = 8,
        retry_s: float = 0.02,
    ) -> None:
        super().__init__(name)
        self.model_url = model_url.rstrip("/")
        self.resources_url = resources_url.rstrip("/")
        self.turns_per_step = turns_per_step
        self.tokens_per_turn = tokens_per_turn
        self.retry_s = retry_s
        self.participant = AgentParticipant()
        self.model_calls = 0
        self.model_refusals = 0
        self.tool_calls = 0
        self.activations = 0
        # Runs inside the model call's replay step, after the reply arrived (a
        # test seam: a delay here is the window where the model has delivered
        # but the agent still counts as at the boundary before the call).
        self.after_model: Callable[[EpisodeId, dict[str, Any]], Awaitable[None]] | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/ng-rollout/{key}/activate", guarded(self.activate))
        app.router.add_post("/ng-rollout/{key}/close", guarded(self.close))
        app.router.add_get("/stats", self.stats_route)
        return app

    async def activate(self, request: web.Request) -> web.Response:
        self.calls["activate"] += 1
        episode = episode_of(request)
        self.check_attempt(episode)
        body = await json_object(request)
        step, observation = want_int(body, "step", high=100_000), want_str(body, "observation")
        await self.participant.wait_open()
        self.check_attempt(episode)  # retired while it waited
        ep = self.participant.steps.begin(episode)
        try:
            async with ep:
                snapshot = self._start(episode, step, observation)
                ep.boundary(snapshot)
                if not snapshot["done"]:
                    self.activations += 1
                    snapshot = await self._run(ep, episode, snapshot)
                return web.json_response({"result": snapshot["result"]})
        finally:
            # The session keeps the last boundary the activation reached (none
            # if it was refused before it had one).
            if not ep.retire_requested and ep.boundary_state is not None:
                self.participant.save(episode, ep.boundary_state)

    def _start(self, episode: EpisodeId, step: int, observation: str) -> dict[str, Any]:
        session = self.participant.session(episode)
        if session is not None:
            session = check_session(session, episode.capture_key)
            if session["step"] == step:
                return session  # a restored or repeated activation of this step
            if session["step"] + 1 == step and session["done"]:
                return new_step(session, step, observation)
            raise InvalidRequest(f"session {episode} is at step {session['step']}, not {step - 1}")
        if step != 0:
            raise NotFound(f"no agent session for {episode} (step {step})")
        return new_step(None, 0, observation)

    async def _run(self, ep: Any, episode: EpisodeId, snap: dict[str, Any]) -> dict[str, Any]:
        while snap["turn"] < self.turns_per_step:
            # Waiting on the model counts as parked at the boundary before it.
            async with ep.step("replay", name=f"model-{snap['step']}.{snap['turn']}"):
                reply = await self._model(episode, snap["messages"])
                if self.after_model is not None:
                    await self.after_model(episode, reply)
            text, tokens, call = parse_output(reply)
            args = orjson.loads(call["arguments"] or "{}")
            async with ep.step("wait", name=f"tool-{snap['step']}.{snap['turn']}") as st:
                url = f"{self.resources_url}{rollout_path(episode, call['name'])}"
                self.tool_calls += 1
                output, _ = await self.downstream.post(url, args)
                turn = {"tokens": tokens, "text": text, "tool": call["name"], "arguments": args}
                turns = [*snap["turns"], {**turn, "output": output}]
                done = snap["turn"] + 1 >= self.turns_per_step
                snap = {
                    **snap,
                    "turn": snap["turn"] + 1,
                    "done": done,
                    "messages": [
                        *snap["messages"],
                        {"role": "assistant", "content": text},
                        call,
                        {
                            "type": "function_call_output",
                            "call_id": call["call_id"],
                            "output": orjson.dumps(output).decode(),
                        },
                    ],
                    "turns": turns,
                    "result": {"step": snap["step"], "turns": turns} if done else None,
                }
                st.boundary(snap)
        return snap

    async def _model(self, episode: EpisodeId, messages: list[Any]) -> dict[str, Any]:
        url = f"{self.model_url}{rollout_path(episode, '/v1/responses')}"
        body = {
            "model": "scripted",
            "input": messages,
            "tools": TOOLS,
            "max_output_tokens": self.tokens_per_turn,
        }
        headers = {MODEL_CALL_HEADER: str(model_calls_in(messages))}
        while True:
            self.model_calls += 1
            try:
                reply, _ = await self.downstream.post(url, body, headers)
                return reply
            except AdmissionClosed:
                # The model is checkpointing: retry after its resume.
                self.model_refusals += 1
                await asyncio.sleep(self.retry_s)

    async def close(self, request: web.Request) -> web.Response:
        self.calls["close"] += 1
        episode = episode_of(request)
        closed = self.participant.close(episode)
        # The episode is done: the model frees the attempt's ledger.  Best
        # effort, as the environment's close is (a lost close is freed by
        # retire or forget); the model may hold rows the agent never had.
        with contextlib.suppress(CheckpointError):
            await self.downstream.post(f"{self.model_url}{rollout_path(episode, '/close')}", {})
        return web.json_response({"closed": closed})

    def stats(self) -> dict[str, Any]:
        return {
            **self.base_stats(),
            "model_calls": self.model_calls,
            "model_refusals": self.model_refusals,
            "tool_calls": self.tool_calls,
            "activations": self.activations,
            "sessions": self.participant.session_count(),
            "live_activations": self.participant.live_executions(),
        }


def model_calls_in(messages: list[Any]) -> int:
    """How many model calls a session made: one assistant message each."""
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")


def parse_output(reply: dict[str, Any]) -> tuple[str, list[int], dict[str, Any]]:
    """The text, token ids and function call of a Responses-style reply."""
    text, call = "", None
    for item in reply.get("output") or []:
        if item.get("type") == "message":
            text += "".join(c.get("text", "") for c in item.get("content") or [])
        elif item.get("type") == "function_call":
            call = {k: item[k] for k in ("type", "call_id", "name", "arguments")}
    if call is None:
        raise ParticipantUnavailable("the policy model answered without a function call")
    return text, list(reply.get("token_ids") or []), call


def agent_server(
    *,
    name: str,
    settings: CheckpointSettings,
    model_url: str,
    resources_url: str,
    turns_per_step: int = 2,
    tokens_per_turn: int = 8,
) -> AgentServer:
    return AgentServer(
        name,
        model_url=model_url,
        resources_url=resources_url,
        turns_per_step=turns_per_step,
        tokens_per_turn=tokens_per_turn,
    )
