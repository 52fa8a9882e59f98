"""NeMo Gym's controller call patterns (`nemo_controller`) drive our four reference participants.

The reference fleet runs in process (`participants.local.start_local_fleet`),
each server with our control routes on loopback.  Tests that fail today for
a reason §1.18 of the reference notes gives are `xfail(strict=True)`; the
first assertion that fails in each names the §1.18 point.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from participants.fleet import KIND_ORDER, FleetConfig
from participants.local import LocalFleet, start_local_fleet
from participants.rollout import make_tasks, run_episode
from ray_ckpt.identity import EpisodeId
from tests.conformance.nemo_controller import (
    FORGET_ID,
    RETIRE_ID,
    Controller,
    CoordinationError,
    Member,
    checkpoint_dir,
    restore_id,
)

TOKEN = "conformance-ref-token"
CONFIG = FleetConfig(
    token=TOKEN, step_delay_s=0.05, token_delay_s=0.01, tokens_per_turn=6, turns_per_step=2
)
SLOW = FleetConfig(token=TOKEN, step_delay_s=0.6, tokens_per_turn=4, turns_per_step=1)
TASK = make_tasks(1, steps=2, seed=3)[0]
BLOCKERS = (
    "§1.18: report.blockers must be capture-key strings; NeMo Gym's straggler path "
    "(EpisodeId.from_capture_key) fails on our blocker objects"
)
RETIRE = "§1.18: retire/forget outside an open checkpoint under an ID resumed earlier is served"
PAST_DEADLINE = "§1.18: a prepare past its deadline answers prepared when the participant is ready"
NEVER_SEEN = "§1.18: resume of a never-seen ID while idle answers idempotent: true"
LONG_ID = "§1.18: rollout_id has no 128-character maximum in NeMo Gym (at least 1,024)"

Start = Callable[[FleetConfig], Awaitable[LocalFleet]]


@pytest.fixture
def http(checked_http: aiohttp.ClientSession) -> aiohttp.ClientSession:
    """Every control reply our participants send here is checked against the
    published schema (`ray-ckpt schema`)."""
    return checked_http


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    fleets: list[LocalFleet] = []

    async def go(config: FleetConfig) -> LocalFleet:
        fleets.append(await start_local_fleet(config))
        return fleets[-1]

    yield go
    for fleet in fleets:
        await fleet.stop()


Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


@pytest.fixture
async def spawn() -> AsyncIterator[Spawn]:
    """Background calls, always cancelled and awaited: a task whose exception is never
    retrieved is logged from the garbage collector, and formatting that traceback
    re-enters `ast.parse` (CPython 3.11), which corrupts pytest's own later parses."""
    tasks: list[asyncio.Task[Any]] = []

    def go(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        tasks.append(asyncio.create_task(coro))
        return tasks[-1]

    yield go
    await stop(*tasks)


async def stop(*tasks: asyncio.Task[Any]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def members_of(ctl: Controller, fleet: LocalFleet) -> list[Member]:
    return await ctl.discover({f"srv-{k}": url for k, url in fleet.urls.items()})


def ahead(s: float = 10.0) -> float:
    return time.time() + s


async def statuses(http: aiohttp.ClientSession, fleet: LocalFleet) -> dict[str, dict[str, Any]]:
    out = {}
    for kind, url in fleet.urls.items():
        async with http.get(
            f"{url}/ng-control/v1/checkpoint/status", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as resp:
            out[kind] = await resp.json()
    return out


async def test_discovery_by_status_four_kinds_404_is_not_a_participant(
    start: Start, http: aiohttp.ClientSession
) -> None:
    fleet = await start(CONFIG)
    judge = web.AppRunner(web.Application())
    await judge.setup()
    await web.TCPSite(judge, "127.0.0.1", 0).start()
    host, port = judge.addresses[0][:2]
    ctl = Controller(http, TOKEN)
    try:
        urls = {f"srv-{k}": u for k, u in reversed(fleet.urls.items())}
        members = await ctl.discover({"judge": f"http://{host}:{port}", **urls})
        assert [m.kind for m in members] == list(KIND_ORDER)
        without_model = {k: u for k, u in urls.items() if k != "srv-model"}
        with pytest.raises(CoordinationError, match="no policy model"):
            await ctl.discover(without_model)
        with pytest.raises(CoordinationError):  # a wrong token is a failure, not "absent"
            await Controller(http, "wrong").discover(urls)
    finally:
        await judge.cleanup()


async def test_full_cycle_commit_into_root_restore_fresh_constant_retire_forget_ids(
    start: Start, http: aiohttp.ClientSession, tmp_path: Path, spawn: Spawn
) -> None:
    old = await start(CONFIG)
    expected = await run_episode(http, old.urls["environment"], EpisodeId("base"), TASK)
    ctl = Controller(http, TOKEN)
    members = await members_of(ctl, old)
    run = spawn(run_episode(http, old.urls["environment"], EpisodeId("r0"), TASK))
    await asyncio.sleep(0.1)  # in flight
    cid = "ckpt-0001"
    result = await ctl.prepare(members, cid, ahead())
    assert result.prepared, result.replies
    where = checkpoint_dir(tmp_path, cid)
    scope = result.continued([{"rollout_id": "r0", "attempt": 0}])
    commits = await ctl.commit(members, cid, ahead(), where, scope)
    assert {r["phase"] for r in commits.values()} == {"committed"}
    assert await asyncio.to_thread(Path(where, "gym").is_dir)
    assert await ctl.resume(members, cid, ahead()) == {}
    await stop(run)
    await old.stop()  # the old processes are gone

    new = await start(CONFIG)
    members = await members_of(ctl, new)
    rid = restore_id()
    replies = await ctl.restore(members, rid, ahead(), where, scope)
    assert {r["source_checkpoint_id"] for r in replies.values()} == {cid}
    assert "r0-a1" in {k for r in replies.values() for k in r["restored"]}
    assert await ctl.resume(members, rid, ahead()) == {}
    reply = await run_episode(http, new.urls["environment"], EpisodeId("r0", 1), TASK)
    assert reply["result"] == expected["result"]
    # `retired_rollouts` counts what retire calls left until forget, as NeMo
    # Gym's participants do: the restore's own fence of attempt 0 is no retire.
    assert {s["retired_rollouts"] for s in (await statuses(http, new)).values()} == {0}

    for _ in range(2):  # the collection's constant IDs, called repeatedly
        retired = await ctl.retire(
            members, RETIRE_ID, ahead(), [{"rollout_id": "r0", "attempt": 1}]
        )
        # Which keys a participant lists is its own (what it stopped or was asked):
        # the mark below is what the protocol promises.
        assert all(isinstance(r["retired"], list) for r in retired.values()), retired
    assert {s["retired_rollouts"] for s in (await statuses(http, new)).values()} == {1}
    for i in range(2):
        forgotten = await ctl.forget(members, FORGET_ID, ahead(), ["r0"])
        assert all(r["forgotten"] == (["r0"] if i == 0 else []) for r in forgotten.values()), (
            i, forgotten,
        )  # fmt: skip
    assert {s["retired_rollouts"] for s in (await statuses(http, new)).values()} == {0}


async def test_failed_restore_cleanup_retires_next_attempts_everywhere_then_resumes(
    start: Start, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    old = await start(CONFIG)
    ctl = Controller(http, TOKEN)
    members = await members_of(ctl, old)
    await run_episode(http, old.urls["environment"], EpisodeId("warm"), TASK)
    assert (await ctl.prepare(members, "c1", ahead())).prepared
    where = checkpoint_dir(tmp_path, "c1")
    scope = [{"rollout_id": "warm", "attempt": 0}]
    await ctl.commit(members, "c1", ahead(), where, scope)
    await ctl.resume(members, "c1", ahead())
    shutil.rmtree(Path(where, "gym", "resources"))  # one participant's records are lost
    new = await start(CONFIG)
    members = await members_of(ctl, new)
    with pytest.raises(CoordinationError) as info:
        await ctl.restore(members, restore_id(), ahead(), where, scope)
    assert set(info.value.failures) == {"srv-resources"}
    after = await statuses(http, new)
    assert {s["phase"] for s in after.values()} == {"idle"}
    assert {s["retired_rollouts"] for s in after.values()} == {1}  # warm-a1 retired everywhere
    with pytest.raises(Exception, match=r"stale_attempt|retired"):
        await run_episode(http, new.urls["environment"], EpisodeId("warm", 1), TASK, timeout_s=5)


async def test_straggler_path_resume_then_retire_blockers_under_the_same_id(
    start: Start, http: aiohttp.ClientSession, spawn: Spawn
) -> None:
    fleet = await start(SLOW)
    ctl = Controller(http, TOKEN)
    members = await members_of(ctl, fleet)
    run = spawn(run_episode(http, fleet.urls["environment"], EpisodeId("r0"), TASK))
    await asyncio.sleep(0.2)  # mid tool call
    result = await ctl.prepare(members, "ckpt-s", ahead(0.1))
    assert not result.prepared, result.replies
    assert result.blockers(), result.replies
    try:
        episodes = await ctl.retire_stragglers(members, "ckpt-s", result, ahead())
    except TypeError as exc:
        pytest.fail(f"{BLOCKERS}: {exc}")
    except CoordinationError as exc:
        pytest.fail(f"{RETIRE}: {exc}")
    assert episodes
    assert {e["rollout_id"] for e in episodes} == {"r0"}
    await stop(run)  # attempt 0's caller gives up on it (its reply is not part of the protocol)
    # Re-run as attempt+1, then prepare again: a clean checkpoint.
    reply = await run_episode(http, fleet.urls["environment"], EpisodeId("r0", 1), TASK)
    assert "result" in reply
    assert (await ctl.prepare(members, "ckpt-s2", ahead())).prepared
    await ctl.resume(members, "ckpt-s2", ahead())


async def test_retire_and_forget_under_a_resumed_id_outside_a_checkpoint(
    start: Start, http: aiohttp.ClientSession
) -> None:
    fleet = await start(CONFIG)
    ctl = Controller(http, TOKEN)
    members = await members_of(ctl, fleet)
    assert (await ctl.prepare(members, "c1", ahead())).prepared
    await ctl.resume(members, "c1", ahead())
    try:
        await ctl.retire(members, "c1", ahead(), [{"rollout_id": "gone"}])
        await ctl.forget(members, "c1", ahead(), ["gone"])
    except CoordinationError as exc:
        pytest.fail(f"{RETIRE}: {exc}")


async def test_prepare_past_its_deadline_answers_prepared_when_ready(
    start: Start, http: aiohttp.ClientSession
) -> None:
    fleet = await start(CONFIG)
    ctl = Controller(http, TOKEN)
    members = await members_of(ctl, fleet)
    try:
        result = await ctl.prepare(members, "c1", time.time() - 1.0)
    except CoordinationError as exc:
        pytest.fail(f"{PAST_DEADLINE}: {exc}")
    finally:
        await ctl.resume(members, "c1", ahead())
    assert result.prepared, result.replies


async def test_resume_of_a_never_seen_id_is_idempotent(
    start: Start, http: aiohttp.ClientSession
) -> None:
    fleet = await start(CONFIG)
    ctl = Controller(http, TOKEN)
    members = await members_of(ctl, fleet)
    replies = await ctl._fan(
        members, "resume", {"checkpoint_id": "never-1", "deadline_ts": ahead()}
    )
    assert {r["idempotent"] for r in replies.values()} == {True}, f"{NEVER_SEEN}: {replies}"


async def test_a_long_rollout_id_is_accepted(start: Start, http: aiohttp.ClientSession) -> None:
    fleet = await start(CONFIG)
    ctl = Controller(http, TOKEN)
    members = await members_of(ctl, fleet)
    long_id = "r" * 1024
    try:
        await ctl.retire(members, RETIRE_ID, ahead(), [{"rollout_id": long_id}])
        await ctl.forget(members, FORGET_ID, ahead(), [long_id])
    except CoordinationError as exc:
        pytest.fail(f"{LONG_ID}: {exc}"[:500])
