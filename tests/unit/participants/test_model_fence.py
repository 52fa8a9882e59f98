"""A retired attempt never gains a call, a cut or a ledger row at the policy model.

The fence is checked after the last await before each of them, not only when
the request arrives: a call whose body was still arriving when its attempt
was retired is refused with `stale_attempt` once the body is in.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from participants.fleet import FACTORIES, FleetConfig
from participants.local import start_local_server
from participants.policy_model import PolicyModelParticipant
from participants.servers.model import ModelServer
from ray_ckpt.errors import StaleAttempt
from ray_ckpt.identity import EpisodeId
from ray_ckpt.steps.retire_marks import RetiredAttempts
from tests.unit.helpers import body, until

R = EpisodeId("r")


async def test_a_call_whose_body_arrives_after_the_retire_is_refused_and_leaves_nothing() -> None:
    server = await start_local_server(
        "model", FACTORIES["model"], "m", FleetConfig(), seed=1, tokens_per_turn=4
    )
    try:
        assert server.engine is not None
        model = server.server
        assert isinstance(model, ModelServer)
        payload = orjson.dumps({"model": "scripted", "input": [{"role": "user", "content": "x"}]})
        host, port = server.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        head = (
            f"POST /ng-rollout/r/v1/responses HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n"
        )
        writer.write(head.encode() + payload[:5])
        await writer.drain()
        # The handler runs and waits for the rest of the body.
        await until(lambda: model.calls["responses"] == 1)
        await asyncio.sleep(0.05)
        retire = body("op1", episode_ids=[{"rollout_id": "r", "attempt": 0}])
        await server.engine.handle("retire", retire)
        writer.write(payload[5:])
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        status_line, _, rest = raw.partition(b"\r\n")
        assert b" 409 " in status_line, raw
        assert orjson.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "stale_attempt"
        # Nothing was admitted, generated, cut or recorded for the retired attempt.
        assert model.generated == 0
        assert model.participant.table_sizes() == dict.fromkeys(model.participant.table_sizes(), 0)
        assert model.participant.fresh()
    finally:
        await server.stop()


async def test_an_attempt_retired_after_admission_gains_no_row_and_no_cut() -> None:
    marks = RetiredAttempts()
    model = PolicyModelParticipant()
    model.retired = marks.is_retired
    delivered = model.admit(R, "d1")
    delivered.tokens = [1, 2]
    held = model.admit(R, "d2")
    held.tokens = [3]
    marks.mark(R)  # the retire raises the mark before it stops anything
    with pytest.raises(StaleAttempt):
        model.admit(R, "d3")
    model.deliver(delivered)
    model.delivered(delivered, {"call": delivered.index, "tokens": 2})
    model.close_admission()
    assert model.cuts == {}
    assert model.ledger == {}
    model.open_admission()
    model.drop(held)
    assert model.table_sizes() == dict.fromkeys(model.table_sizes(), 0)
