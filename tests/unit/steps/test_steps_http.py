"""Episode steps in real aiohttp handlers on loopback.

An environment server's `/run` seeds a session on a resources server (which
declares on its `/seed_session` reply whether `/verify` may be replayed),
then verifies in the declared mode.  The test holds `/verify` on an event,
closes admission mid-verify, exports, "crashes" the server, installs the
records into a fresh server and continues the rollout there as attempt 1.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from ray_ckpt.errors import CheckpointError
from ray_ckpt.identity import EpisodeId
from ray_ckpt.steps import (
    RESTART_HEADER,
    VERIFY_HEADER,
    EpisodeSteps,
    StepMode,
    restart_from_headers,
    seed_session_headers,
    verify_mode_from_headers,
)
from ray_ckpt.storage.records.record import Record
from tests.unit.conftest import Serve
from tests.unit.helpers import until


@dataclass
class Env:
    """One environment server's episode table and the test's levers on it."""

    resources_url: str
    steps: EpisodeSteps = field(default_factory=EpisodeSteps)
    verify_started: asyncio.Event = field(default_factory=asyncio.Event)
    release_verify: asyncio.Event = field(default_factory=asyncio.Event)
    verify_runs: int = 0
    cleanups: int = 0
    handler_tasks: list[asyncio.Task[Any]] = field(default_factory=list)


ENV = web.AppKey("env", Env)
SESSION = web.AppKey("session", aiohttp.ClientSession)


async def run(request: web.Request) -> web.Response:
    env = request.app[ENV]
    body = await request.json()
    eid = EpisodeId(body["rollout_id"], body.get("attempt", 0))
    try:
        episode = env.steps.begin(eid, deadline_s=60.0)
    except CheckpointError as exc:
        return web.json_response(exc.to_body(), status=exc.http_status)
    task = asyncio.current_task()
    assert task is not None
    env.handler_tasks.append(task)
    try:
        async with episode as ep:
            state = ep.claim() or {"next": "seed"}
            if state["next"] == "seed":
                async with ep.step("replay", name="seed") as step:
                    url = f"{env.resources_url}/seed_session"
                    async with request.app[SESSION].post(url) as reply:
                        mode = verify_mode_from_headers(reply.headers)
                        assert not restart_from_headers(reply.headers)
                    state = {"next": "verify", "verify_mode": mode.value}
                    step.boundary(state)
            if state["next"] == "verify":
                async with ep.step(state["verify_mode"], name="verify") as step:
                    env.verify_runs += 1
                    env.verify_started.set()
                    await env.release_verify.wait()
                    state = {"next": "return", "reward": 1.0}
                    step.boundary(state)
            return web.json_response({"episode": eid.capture_key, "reward": state["reward"]})
    finally:
        env.cleanups += 1


async def env_app(env: Env) -> web.Application:
    app = web.Application()
    app[ENV] = env

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        # No keep-alive to the resources server: an idle pooled connection
        # would leave its server-side task behind and blur the task check.
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/run", run)
    return app


def resources_app(mode: StepMode) -> web.Application:
    async def seed_session(request: web.Request) -> web.Response:
        return web.json_response({}, headers=seed_session_headers(verify=mode))

    app = web.Application()
    app.router.add_post("/seed_session", seed_session)
    return app


@pytest.mark.parametrize("mode", [StepMode.WAIT, StepMode.REPLAY])
async def test_verify_in_flight_is_waited_for_or_replayed(
    serve: Serve, http: aiohttp.ClientSession, mode: StepMode
) -> None:
    resources_url = await serve(resources_app(mode))
    old = Env(resources_url)
    old_url = await serve(await env_app(old))
    pending = asyncio.create_task(http.post(f"{old_url}/run", json={"rollout_id": "r1"}))
    await old.verify_started.wait()

    old.steps.close_admission()
    async with http.post(f"{old_url}/run", json={"rollout_id": "r2"}) as refused:
        assert refused.status == 409
        assert (await refused.json())["error"]["code"] == "admission_closed"

    if mode is StepMode.WAIT:
        assert not old.steps.ready()
        (blocker,) = old.steps.report(100).blockers
        assert (blocker.key, blocker.state, blocker.step, blocker.mode, blocker.detail) == (
            "r1",
            "wait_step",
            1,
            "wait",
            "verify",
        )
        old.release_verify.set()
        await until(old.steps.ready)
        expected = Record("r1", {"boundary": {"next": "return", "reward": 1.0}, "step": 2})
    else:
        assert old.steps.ready()
        expected = Record(
            "r1", {"boundary": {"next": "verify", "verify_mode": "replay"}, "step": 1}
        )
    records = old.steps.export(None)
    # The deadline budget used so far travels with the boundary.
    spent = records[0].state["spent_s"]
    assert 0 <= spent < 60
    assert records == [Record(expected.key, {**expected.state, "spent_s": spent})]
    await asyncio.sleep(0.02)
    assert not pending.done()  # nothing is delivered while the checkpoint is closed

    # Crash: the old server's work is gone.
    assert await old.steps.retire([EpisodeId("r1")]) == ["r1"]
    with pytest.raises(aiohttp.ClientError):
        await pending
    assert old.cleanups == 1
    assert old.steps.live_executions() == 0

    new = Env(resources_url)
    new_url = await serve(await env_app(new))
    new.release_verify.set()
    new.steps.close_admission()  # a restore keeps admission closed until resume
    assert new.steps.install(records) == [EpisodeId("r1", 1)]
    replacement = asyncio.create_task(
        http.post(f"{new_url}/run", json={"rollout_id": "r1", "attempt": 1})
    )
    await until(lambda: new.steps.report(10).counts == {"parked": 1})
    assert new.verify_runs == 0  # parked until resume
    new.steps.open_admission()
    async with await replacement as reply:
        assert reply.status == 200
        assert await reply.json() == {"episode": "r1-a1", "reward": 1.0}
    assert new.verify_runs == (1 if mode is StepMode.REPLAY else 0)
    assert old.verify_runs == 1
    assert new.steps.live_executions() == 0
    assert new.steps.restored_ids() == []


async def test_a_checkpoint_without_a_crash_parks_then_delivers(
    serve: Serve, http: aiohttp.ClientSession
) -> None:
    env = Env(await serve(resources_app(StepMode.WAIT)))
    url = await serve(await env_app(env))
    pending = asyncio.create_task(http.post(f"{url}/run", json={"rollout_id": "r1"}))
    await env.verify_started.wait()
    env.steps.close_admission()
    env.release_verify.set()
    await until(env.steps.ready)
    await asyncio.sleep(0.02)
    assert not pending.done()
    env.steps.open_admission()
    async with await pending as reply:
        assert await reply.json() == {"episode": "r1", "reward": 1.0}
    assert env.verify_runs == 1


async def test_retire_mid_step_leaves_no_handler_task_behind(
    serve: Serve, http: aiohttp.ClientSession
) -> None:
    env = Env(await serve(resources_app(StepMode.REPLAY)))
    url = await serve(await env_app(env))
    before = asyncio.all_tasks()
    pending = asyncio.create_task(http.post(f"{url}/run", json={"rollout_id": "r1"}))
    await env.verify_started.wait()
    assert await env.steps.retire([EpisodeId("r1")]) == ["r1"]
    (handler,) = env.handler_tasks
    assert handler.done()
    assert env.cleanups == 1
    assert env.steps.live_executions() == 0
    assert env.steps.report(10).counts == {}
    with contextlib.suppress(aiohttp.ClientError):
        await pending
    await until(lambda: asyncio.all_tasks() <= before)
    assert handler not in asyncio.all_tasks()


def test_seed_session_headers_round_trip() -> None:
    assert seed_session_headers() == {VERIFY_HEADER: "wait"}
    headers = seed_session_headers(verify="replay", restart=True)
    assert headers == {VERIFY_HEADER: "replay", RESTART_HEADER: "1"}
    assert verify_mode_from_headers(headers) is StepMode.REPLAY
    assert restart_from_headers(headers)
    assert verify_mode_from_headers({}) is StepMode.WAIT
    assert verify_mode_from_headers({"X-NG-Checkpoint-Verify": "REPLAY"}) is StepMode.REPLAY
    assert verify_mode_from_headers({VERIFY_HEADER: "sometimes"}) is StepMode.WAIT
    assert not restart_from_headers({RESTART_HEADER: "0"})
    with pytest.raises(CheckpointError):
        seed_session_headers(verify="maybe")  # type: ignore[arg-type]
