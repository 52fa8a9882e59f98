"""Completion receipts through the real engine and the real control routes:
held results in status, ack and collect, the prepare bound, the scope check,
and a checkpoint that carries the unacknowledged results into a fresh process."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from pydantic import SecretStr

from participants.environment import EnvironmentParticipant
from ray_ckpt.control.asgi import ControlASGIMiddleware
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.control.routes import CHECKPOINT_ROUTE_PREFIX, control_app
from ray_ckpt.errors import (
    FinishedInScope,
    InvalidCheckpointState,
    ReceiptsOff,
    UnknownReceipt,
)
from ray_ckpt.gym_server.serving import bind_socket, serve_app, socket_address
from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import Receipt
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.steps import EpisodeSteps
from ray_ckpt.steps.episode_participant import EpisodeParticipant
from ray_ckpt.steps.receipts import ResultReceipts
from ray_ckpt.storage import write_gym_manifest
from ray_ckpt.storage.participant.participant_manifest import ParticipantManifest
from tests.unit.conftest import Serve
from tests.unit.helpers import body

TOKEN = "receipts-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SETTINGS = CheckpointSettings(
    enabled=True, control_auth_token=SecretStr(TOKEN), completion_receipts=True
)


def env(max_results: int = 100) -> tuple[ParticipantEngine, EnvironmentParticipant]:
    steps = EpisodeSteps()
    receipts = ResultReceipts(max_results=max_results, max_bytes=1 << 20)
    participant = EnvironmentParticipant(steps, receipts)
    return ParticipantEngine(participant, instance="env0", settings=SETTINGS), participant


async def finish(p: EnvironmentParticipant, eid: EpisodeId, result: Any) -> Receipt:
    """One episode run to its end as the environment server runs one."""
    async with p.steps.begin(eid) as ep, ep.step("replay", name="work") as step:
        step.boundary({"next": "return"})
    receipt = p.hold(eid, result)
    assert receipt is not None
    return receipt


def wire(receipts: list[Receipt]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = msgspec.to_builtins(receipts)
    return out


async def test_status_collect_and_ack_and_idempotent_re_ack() -> None:
    ctl, p = env()
    a = await finish(p, EpisodeId("r1"), {"reward": 1})
    b = await finish(p, EpisodeId("r2"), {"reward": 2})
    st = ctl.status()
    assert (st["completion_receipts"], st["unacknowledged_results"]) == (True, 2)
    assert st["unacknowledged_bytes"] == p.receipts.bytes > 0  # type: ignore[union-attr]
    got = await ctl.handle("collect", {})
    assert got["results"] == [
        {"receipt": wire([a])[0], "result": {"reward": 1}},
        {"receipt": wire([b])[0], "result": {"reward": 2}},
    ]
    reply = await ctl.handle("ack", {"receipts": wire([a])})
    assert (reply["acknowledged"], reply["already"]) == (wire([a]), [])
    assert reply["unacknowledged_results"] == 1
    again = await ctl.handle("ack", {"receipts": wire([a, b])})
    assert (again["acknowledged"], again["already"]) == (wire([b]), wire([a]))
    assert (await ctl.handle("collect", {}))["results"] == []
    unknown = Receipt(rollout_id="r3", digest="c" * 64)
    with pytest.raises(UnknownReceipt):
        await ctl.handle("ack", {"receipts": wire([unknown])})
    check = await ctl.handle("ack", {"receipts": wire([a, unknown]), "check": True})
    assert (check["known"], check["unknown"]) == (wire([a]), wire([unknown]))


async def test_a_participant_without_receipts_refuses_ack_and_collects_nothing() -> None:
    ctl = ParticipantEngine(
        EpisodeParticipant("environment", EpisodeSteps()), instance="e", settings=SETTINGS
    )
    receipt = Receipt(rollout_id="r1", digest="a" * 64)
    with pytest.raises(ReceiptsOff):
        await ctl.handle("ack", {"receipts": wire([receipt])})
    reply = await ctl.handle("collect", {})
    assert (reply["results"], reply["completion_receipts"]) == ([], False)
    assert ctl.status()["unacknowledged_results"] == 0


async def test_prepare_reports_the_bound_blocker_until_an_ack_frees_room() -> None:
    ctl, p = env(max_results=1)
    first = await finish(p, EpisodeId("r1"), {"reward": 1})
    await finish(p, EpisodeId("r2"), {"reward": 2})
    short = {"checkpoint_id": "c1", "deadline_ts": time.time() + 0.2}
    reply = await ctl.handle("prepare", short)
    assert reply["phase"] == "preparing"
    assert reply["report"]["blockers"] == ["unacknowledged-results:2"]
    # A prepare waiting at the bound is woken by the acknowledgement.
    waiting = asyncio.create_task(ctl.handle("prepare", body("c1")))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await ctl.handle("ack", {"receipts": wire([first])})
    assert (await asyncio.wait_for(waiting, 5))["phase"] == "prepared"
    await ctl.handle("resume", body("c1"))


async def test_a_scope_naming_a_finished_episode_refuses_the_commit_and_writes_nothing(
    tmp_path: Path,
) -> None:
    ctl, p = env()
    await finish(p, EpisodeId("r1"), {"reward": 1})
    await ctl.handle("prepare", body("c1"))
    scope = [{"rollout_id": "r1", "attempt": 0}]
    with pytest.raises(FinishedInScope) as err:
        await ctl.handle("commit", body("c1", checkpoint_dir=str(tmp_path), episode_ids=scope))
    assert "r1" in err.value.detail
    assert err.value.code == "finished_in_scope"
    assert await asyncio.to_thread(lambda: list(tmp_path.rglob("manifest.json"))) == []
    await ctl.handle("resume", body("c1"))
    assert ctl.status()["unacknowledged_results"] == 1


async def test_a_checkpoint_carries_unacknowledged_results_into_a_fresh_process(
    tmp_path: Path,
) -> None:
    ctl, p = env()
    a = await finish(p, EpisodeId("r1"), {"reward": 1})
    acked = await finish(p, EpisodeId("r2"), {"reward": 2})
    await ctl.handle("ack", {"receipts": wire([acked])})
    await ctl.handle("prepare", body("c1"))
    committed = await ctl.handle("commit", body("c1", checkpoint_dir=str(tmp_path), episode_ids=[]))
    assert (committed["episode_ids"], committed["results"]) == ([], 1)
    await ctl.handle("resume", body("c1"))

    ctl2, _ = env()
    where = str(tmp_path)
    restored = await ctl2.handle("restore", body("c1", checkpoint_dir=where, episode_ids=[]))
    assert restored["restored"] == []
    got = (await ctl2.handle("collect", {}))["results"]
    assert got == [{"receipt": wire([a])[0], "result": {"reward": 1}}]
    await ctl2.handle("ack", {"receipts": wire([a])})
    await ctl2.handle("resume", body("c1"))
    assert ctl2.status()["unacknowledged_results"] == 0

    # Where receipts are off the results cannot be installed: refused, not dropped.
    off = ParticipantEngine(
        EnvironmentParticipant(EpisodeSteps()), instance="env0", settings=SETTINGS
    )
    with pytest.raises(InvalidCheckpointState) as err:
        await off.handle("restore", body("c1", checkpoint_dir=str(tmp_path), episode_ids=[]))
    assert "completion_receipts" in str(err.value)


# --- the routes ---------------------------------------------------------------------


async def _no_app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("control calls never reach the wrapped app")


@pytest.mark.parametrize("front", ["aiohttp", "asgi"])
async def test_ack_route_is_bearer_protected_typed_and_idempotent(
    serve: Serve, http: aiohttp.ClientSession, front: str
) -> None:
    ctl, p = env()
    a = await finish(p, EpisodeId("r1"), {"reward": 1})
    serving = None
    if front == "aiohttp":
        base = await serve(control_app(ctl, token=TOKEN))
    else:
        sock = bind_socket("127.0.0.1", 0)
        serving = await serve_app(ControlASGIMiddleware(_no_app, ctl, token=TOKEN), sock)
        host, port = socket_address(sock)
        base = f"http://{host}:{port}"
    try:
        await _ack_route_checks(http, base, ctl, a)
    finally:
        if serving is not None:
            await serving.stop()


async def _ack_route_checks(
    http: aiohttp.ClientSession, base: str, ctl: ParticipantEngine, a: Receipt
) -> None:
    ack_url = f"{base}{CHECKPOINT_ROUTE_PREFIX}/ack"
    payload = {"receipts": wire([a])}
    for headers in ({}, {"Authorization": "Bearer nope"}):
        async with http.post(ack_url, json=payload, headers=headers) as r:
            assert (r.status, (await r.json())["error"]["code"]) == (401, "unauthorized")
    assert ctl.status()["unacknowledged_results"] == 1
    unknown = {"receipts": wire([a, Receipt(rollout_id="zz", digest="d" * 64)])}
    async with http.post(ack_url, json=unknown, headers=AUTH) as r:
        assert (r.status, (await r.json())["error"]["code"]) == (404, "unknown_receipt")
    assert ctl.status()["unacknowledged_results"] == 1  # nothing changed
    async with http.post(ack_url, json={"receipts": "x"}, headers=AUTH) as r:
        assert (r.status, (await r.json())["error"]["code"]) == (400, "invalid_request")
    first = {"acknowledged": wire([a]), "already": []}
    for expected in (first, {"acknowledged": [], "already": wire([a])}):
        async with http.post(ack_url, json=payload, headers=AUTH) as r:
            assert r.status == 200
            reply = await r.json()
        assert {k: reply[k] for k in expected} == expected
    async with http.post(f"{base}{CHECKPOINT_ROUTE_PREFIX}/collect", json={}) as r:
        assert r.status == 401
    async with http.post(f"{base}{CHECKPOINT_ROUTE_PREFIX}/collect", json={}, headers=AUTH) as r:
        assert (r.status, (await r.json())["results"]) == (200, [])
    async with http.get(ack_url, headers=AUTH) as r:
        assert (r.status, r.headers["Allow"]) == (405, "POST")


async def test_an_incremental_checkpoint_references_the_unchanged_held_result(
    tmp_path: Path,
) -> None:
    ctl, p = env()
    a = await finish(p, EpisodeId("r1"), {"reward": 1, "text": "x" * 4000})
    for cid in ("c1", "c2"):
        await ctl.handle("prepare", body(cid))
        where = str(tmp_path / cid)
        reply = await ctl.handle("commit", body(cid, checkpoint_dir=where, episode_ids=[]))
        manifest = msgspec.convert(reply["manifest"], ParticipantManifest)
        await asyncio.to_thread(write_gym_manifest, where, checkpoint_id=cid, manifests=[manifest])
        await ctl.handle("resume", body(cid))
    refs = [r.key for r in manifest.refs]
    assert refs == ["result:r1"]  # c2 points into c1 for the unchanged held result
    ctl2, _ = env()
    where = str(tmp_path / "c2")
    await ctl2.handle("restore", body("c2", checkpoint_dir=where, episode_ids=[]))
    got = (await ctl2.handle("collect", {}))["results"]
    assert [g["receipt"] for g in got] == wire([a])
