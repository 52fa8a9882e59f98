"""Generation cuts continue only the generation they were cut from.

A reference model server on loopback is checkpointed mid-generation, thrown
away and restored into a fresh one; the re-issued calls of attempt 1 must get
exactly what an uninterrupted call with the same request gets.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from participants.fleet import FACTORIES, FleetConfig
from participants.local import LocalServer, start_local_server
from participants.servers.model import ModelServer
from tests.unit.helpers import body, until

CONFIG = FleetConfig()
CONVERSATION = [{"role": "user", "content": "pick a number"}]
REQUEST: dict[str, Any] = {"model": "scripted", "input": CONVERSATION, "max_output_tokens": 8}
IDS = [{"rollout_id": "r", "attempt": 0}]


async def model_server(name: str) -> LocalServer:
    return await start_local_server(
        "model", FACTORIES["model"], name, CONFIG, seed=5, tokens_per_turn=8, token_delay_s=0.02
    )


def model_of(server: LocalServer) -> ModelServer:
    assert isinstance(server.server, ModelServer)
    return server.server


async def respond(
    http: aiohttp.ClientSession, server: LocalServer, key: str, request: dict[str, Any]
) -> dict[str, Any]:
    async with http.post(f"{server.url}/ng-rollout/{key}/v1/responses", json=request) as resp:
        reply: dict[str, Any] = await resp.json()
        assert resp.status == 200, reply
        return reply


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def cut_and_restore(
    http: aiohttp.ClientSession, tmp_path: Path
) -> tuple[list[int], LocalServer, int]:
    """The uninterrupted tokens, and a fresh server restored from a checkpoint
    taken while attempt 0's call was mid-generation (with the cut's length)."""
    old = await model_server("m")
    try:
        expected = (await respond(http, old, "base", REQUEST))["token_ids"]
        run = asyncio.create_task(respond(http, old, "r", REQUEST))
        calls = model_of(old).participant.calls
        await until(lambda: any(len(c.tokens) == 6 for c in calls.values()))
        assert old.engine is not None
        assert (await old.engine.handle("prepare", body("c1")))["phase"] == "prepared"
        cut = model_of(old).participant.cuts
        assert len(cut) == 1
        cut_len = len(next(iter(cut.values())).tokens)
        assert 6 <= cut_len < 8  # a 4-token request must not get these back
        where = str(tmp_path / "c1")
        await old.engine.handle("commit", body("c1", checkpoint_dir=where, episode_ids=IDS))
        run.cancel()
    finally:
        await old.stop()
    new = await model_server("m")
    assert new.engine is not None
    await new.engine.handle("restore", body("c1", checkpoint_dir=where, episode_ids=IDS))
    await new.engine.handle("resume", body("c1"))
    return expected, new, cut_len


@pytest.mark.parametrize(
    "change",
    [
        {"max_output_tokens": 4},
        {"max_output_tokens": 7},
        {"temperature": 0.3},
        {"top_p": 0.5},
        {"stop": ["seven"]},
        {"tool_choice": "required"},
        {"text": {"format": {"type": "json_schema", "name": "n", "schema": {}}}},
    ],
    ids=lambda c: next(iter(c)),
)
async def test_a_cut_continues_only_a_call_with_the_same_generation_parameters(
    http: aiohttp.ClientSession, tmp_path: Path, change: dict[str, Any]
) -> None:
    expected, new, cut_len = await cut_and_restore(http, tmp_path)
    try:
        model = model_of(new)
        other = await respond(http, new, "r-a1", {**REQUEST, **change})
        limit = int(change.get("max_output_tokens", 8))
        # Generated from scratch under its own request: never past its own limit,
        # never the cut's prefix made under another.
        assert other["usage"]["output_tokens"] == len(other["token_ids"]) == limit
        assert other["token_ids"] == expected[:limit]
        assert (model.continued, model.participant.counts["cut_unmatched"]) == (0, 1)
        # The unmatched call left the cut for the call it belongs to.
        same = await respond(http, new, "r-a1", REQUEST)
        assert same["token_ids"] == expected
        assert model.participant.counts["calls_continued"] == 1
        assert model.continued == cut_len
        assert model.participant.restored_cuts == {}
    finally:
        await new.stop()


async def test_bookkeeping_fields_do_not_make_a_call_unmatched(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    expected, new, cut_len = await cut_and_restore(http, tmp_path)
    try:
        # `metadata` and `user` do not change the tokens; an absent limit is the
        # default one (8), the limit the cut was made under.
        request = {k: v for k, v in REQUEST.items() if k != "max_output_tokens"}
        reply = await respond(http, new, "r-a1", {**request, "metadata": {"a": "b"}, "user": "u"})
        assert reply["token_ids"] == expected
        assert model_of(new).continued == cut_len
    finally:
        await new.stop()
