"""The reference policy model: a scripted, seeded token generator.

`POST /ng-rollout/<key>/v1/responses` takes an OpenAI Responses-style request
(`{"model", "input": [...], "tools": [...], "max_output_tokens"}`) and answers
`{"id", "object": "response", "output": [message, function_call?], "usage"}`.
Token `i` of a generation is a pure function of (seed, conversation digest, i),
and each token takes `token_delay_s`, so a generation can be in flight when a
checkpoint closes and a continued prefix yields exactly the tokens an
uninterrupted run would.  When the request offers tools, the output ends in a
`function_call` chosen from the tokens.  `GET /stats` reports calls, tokens
generated and continued, cuts, live calls and ledger entries.

`POST /ng-rollout/<key>/close` says the caller is done with the attempt (the
agent sends it when the environment closes the session): the attempt's ledger
rows are handed to `participant.collect` and freed (never refused).

A generation is defined by its conversation (`model`, `input`, `tools`: the
tokens are a function of it) and its generation parameters (everything else
in the body but the fields in `NON_GENERATION_FIELDS`, with the effective
`max_output_tokens`): a restored cut continues only a call whose both match.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from participants.common import (
    MODEL_CALL_HEADER,
    ServerBase,
    digest,
    episode_of,
    guarded,
    json_object,
)
from participants.model_calls import Call
from participants.policy_model import PolicyModelParticipant
from ray_ckpt.errors import InvalidRequest
from ray_ckpt.settings import CheckpointSettings

if TYPE_CHECKING:
    from ray_ckpt.control.engine import ParticipantEngine

CONVERSATION_FIELDS = ("model", "input", "tools")
# Request fields that cannot change which tokens come out (bookkeeping and
# transport).  Every other field counts as generation-defining, so a field this
# list does not know costs a regeneration, never a wrong continuation.
NON_GENERATION_FIELDS = frozenset(
    {
        "metadata",
        "user",
        "store",
        "stream",
        "stream_options",
        "service_tier",
        "include",
        "background",
        "prompt_cache_key",
        "safety_identifier",
    }
)
MAX_CALL_POSITION = 1_000_000

VOCAB = [
    "the",
    "a",
    "guess",
    "number",
    "is",
    "higher",
    "lower",
    "try",
    "again",
    "maybe",
    "seven",
    "think",
    "so",
    "next",
    "value",
    "check",
    "hint",
    "parity",
    "odd",
    "even",
    "small",
    "large",
    "middle",
    "pick",
    "one",
    "more",
    "step",
    "plan",
    "ok",
    "then",
    "now",
]


def token_at(seed: int, conversation: str, position: int) -> int:
    data = f"{seed}:{conversation}:{position}".encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=4).digest(), "big")


def render(tokens: list[int]) -> str:
    return " ".join(VOCAB[t % len(VOCAB)] for t in tokens)


def function_call(tokens: list[int], tools: list[dict[str, Any]], conversation: str) -> Any:
    """The tool call the scripted model makes, read off its own tokens."""
    tool = tools[tokens[-1] % len(tools)]
    name = str(tool.get("name", "tool"))
    args: dict[str, Any] = {"value": tokens[0] % 100} if name == "guess" else {}
    return {
        "type": "function_call",
        "call_id": f"call_{conversation[:12]}",
        "name": name,
        "arguments": orjson.dumps(args).decode(),
    }


class ModelServer(ServerBase):
    kind = "model"

    def __init__(
        self, name: str, *, seed: int = 0, tokens_per_turn: int = 8, token_delay_s: float = 0.0
    ) -> None:
        super().__init__(name)
        self.seed = seed
        self.tokens_per_turn = tokens_per_turn
        self.token_delay_s = token_delay_s
        # Nothing is recorded until a engine attaches (checkpointing on).
        self.participant = PolicyModelParticipant(recording=False)
        self.generated = 0
        self.continued = 0

    def attach(self, engine: ParticipantEngine) -> None:
        super().attach(engine)
        self.participant.recording = True
        # Read through the engine: its marks object is a public attribute.
        self.participant.retired = lambda episode: engine.retired.is_retired(episode)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/ng-rollout/{key}/v1/responses", guarded(self.responses))
        app.router.add_post("/ng-rollout/{key}/close", guarded(self.close))
        app.router.add_get("/stats", self.stats_route)
        return app

    async def close(self, request: web.Request) -> web.Response:
        self.calls["close"] += 1
        return web.json_response({"closed": self.participant.finish(episode_of(request))})

    async def responses(self, request: web.Request) -> web.StreamResponse:
        self.calls["responses"] += 1
        episode = episode_of(request)
        self.check_attempt(episode)
        body = await json_object(request)
        items = body.get("input")
        if not isinstance(items, list) or not items:
            raise InvalidRequest("'input' must be a non-empty list of items")
        tools = body.get("tools") or []
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise InvalidRequest("'tools' must be a list of objects")
        limit = body.get("max_output_tokens", self.tokens_per_turn)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 4096:
            raise InvalidRequest("'max_output_tokens' must be an integer in [1, 4096]")
        position = call_position(request)
        conversation = digest({"model": body.get("model"), "input": items, "tools": tools})
        params = generation_params(body, limit)
        # After the last await before admission: a retire that ran while the
        # body was arriving is seen here (admit checks the marks again).
        self.check_attempt(episode)
        call = self.participant.admit(episode, conversation, params, position=position, limit=limit)
        try:
            await self._generate(call, limit)
            await self.participant.hold(call)
            self.check_attempt(episode)  # retired while it generated or was held
            self.participant.deliver(call)
            reply = self._response(call, tools, len(items))
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(orjson.dumps(reply))
            await resp.write_eof()
            self.participant.delivered(
                call,
                {
                    "call": call.index,
                    "digest": call.digest,
                    "tokens": len(call.tokens),
                    "continued": call.continued,
                },
            )
            return resp
        finally:
            self.participant.drop(call)

    async def _generate(self, call: Call, limit: int) -> None:
        self.continued += call.continued
        while len(call.tokens) < limit:
            if self.token_delay_s > 0:
                await asyncio.sleep(self.token_delay_s)
            # Appended whole: a cut sees a prefix that ends at a token boundary.
            call.tokens.append(token_at(self.seed, call.digest, len(call.tokens)))
            self.generated += 1

    def _response(self, call: Call, tools: list[dict[str, Any]], n_input: int) -> dict[str, Any]:
        tokens = call.tokens
        output: list[dict[str, Any]] = [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": render(tokens)}],
            }
        ]
        if tools:
            output.append(function_call(tokens, tools, call.digest))
        return {
            "id": f"resp_{call.digest[:16]}",
            "object": "response",
            "model": "scripted",
            "output": output,
            "token_ids": tokens,
            "usage": {
                "input_tokens": n_input,
                "output_tokens": len(tokens),
                "total_tokens": n_input + len(tokens),
            },
        }

    def stats(self) -> dict[str, Any]:
        p = self.participant
        return {
            **self.base_stats(),
            "tokens_generated": self.generated,
            "tokens_continued": self.continued,
            "live_calls": len(p.calls),
            "generating": sum(1 for c in p.calls.values() if not c.delivering),
            # Tokens so far of each undelivered call: how far a cut would reach.
            "in_flight_tokens": sorted(len(c.tokens) for c in p.calls.values() if not c.delivering),
            "ledger_entries": sum(len(rows) for rows in p.ledger.values()),
            "finishing": len(p.finishing),
            "ledgers": len(p.ledger),
            "cuts": len(p.cuts),
            "restored_cuts": len(p.restored_cuts),
            "counts": dict(p.counts),
        }


def call_position(request: web.Request) -> int | None:
    """The caller's position of this call (`x-ng-model-call`), if it sent one."""
    raw = request.headers.get(MODEL_CALL_HEADER)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) > MAX_CALL_POSITION:
        raise InvalidRequest(f"{MODEL_CALL_HEADER} must be an integer in [0, {MAX_CALL_POSITION}]")
    return int(raw)


def generation_params(body: dict[str, Any], limit: int) -> str:
    """Digest of what, besides the conversation, decides the generated tokens."""
    params = {
        k: v
        for k, v in body.items()
        if k not in CONVERSATION_FIELDS and k not in NON_GENERATION_FIELDS
    }
    params["max_output_tokens"] = limit  # absent and default are the same limit
    return digest(params)


def model_server(
    *,
    name: str,
    settings: CheckpointSettings,
    seed: int = 0,
    tokens_per_turn: int = 8,
    token_delay_s: float = 0.0,
) -> ModelServer:
    return ModelServer(
        name, seed=seed, tokens_per_turn=tokens_per_turn, token_delay_s=token_delay_s
    )
