"""A multi-worker host: one control plane over real worker processes.

Every test runs the reference counter server in 2-3 real worker processes
sharing one port; kills are real `kill -9`s of worker processes.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from ray_ckpt.errors import InvalidPhase, ParticipantUnavailable
from ray_ckpt.hosting.host import ParticipantHost
from ray_ckpt.workers.routing import owner_index
from tests.workers.conftest import AUTH, StartHost, body, kill9, step, step_open


def owned_by(index: int, workers: int, n: int = 1) -> list[str]:
    """`n` rollout IDs the worker `index` owns among `workers`."""
    out = [f"r{i}" for i in range(200) if owner_index(f"r{i}", workers) == index]
    return out[:n]


def worker_of(host: ParticipantHost, pid: int) -> str:
    assert host.plane is not None
    return next(w for w, p in host.plane.pool.pids().items() if p == pid)


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll a condition another process changes (no event to wait on)."""
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_close_and_reopen_reach_every_worker_and_control_is_answered_by_the_host(
    start_host: StartHost, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    host = await start_host(2)
    rollouts = owned_by(0, 2, 2) + owned_by(1, 2, 2)
    for key in rollouts:
        assert (await step(http, host.url, key))[0] == 200
    served = {worker_of(host, (await step(http, host.url, key))[1]["pid"]) for key in rollouts}
    assert served == {"w0", "w1"}  # affine: both workers hold rollouts
    prepared = await host.call("prepare", body("c1"))
    assert prepared["phase"] == "prepared"
    for key in rollouts:  # closed on every worker, whichever accepts the call
        status, reply = await step(http, host.url, key)
        assert (status, reply["error"]["code"]) == (409, "admission_closed")
    # A control call over HTTP, reaching some worker, is answered by the host.
    for _ in range(4):
        async with http.get(f"{host.url}/ng-control/v1/checkpoint/status", headers=AUTH) as r:
            status = await r.json()
        assert status["phase"] == "prepared"
        assert status["workers"]["reported"] == ["w0", "w1"]
    committed = await host.call("commit", body("c1", checkpoint_dir=str(tmp_path)))
    assert sorted(committed["episode_ids"]) == sorted(rollouts)  # both workers exported
    async with http.post(
        f"{host.url}/ng-control/v1/checkpoint/resume", json=body("c1"), headers=AUTH
    ) as r:
        assert (await r.json())["phase"] == "idle"
    for key in rollouts:
        status, reply = await step_open(http, host.url, key)
        assert (status, reply["count"]) == (200, 3)


async def test_worker_killed_mid_prepare_blocks_by_name_and_its_replacement_starts_closed(
    start_host: StartHost, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    host = await start_host(2)
    assert host.plane is not None
    [busy] = owned_by(1, 2)
    held = asyncio.ensure_future(step(http, host.url, busy, hold_s=30.0))
    await wait_for(lambda: host.plane.table.live() == 1)  # type: ignore[union-attr]
    first = await host.call("prepare", body("c1", wait_s=0.3))
    assert first["phase"] == "preparing"
    assert first["report"]["blockers"] == [busy]
    old_pid = host.plane.pool.pids()["w1"]
    kill9(old_pid)
    # Forwarded by the other worker (a 503) or accepted by the killed one (torn).
    try:
        status, reply = await held
        assert (status, reply["error"]["code"]) == (503, "participant_unavailable")
    except aiohttp.ClientError:
        pass
    # The replacement starts while the checkpoint is open: it starts closed,
    # and the loss still blocks (its episodes are gone from this checkpoint).
    await wait_for(lambda: host.plane.pool.pids().get("w1") not in (None, old_pid))
    again = await host.call("prepare", body("c1", wait_s=0.3))
    assert again["phase"] == "preparing"
    assert again["report"]["blockers"] == ["worker-lost:w1"]
    status, reply = await step(http, host.url, busy)
    assert (status, reply["error"]["code"]) == (409, "admission_closed")
    with pytest.raises(InvalidPhase):
        await host.call("commit", body("c1", checkpoint_dir=str(tmp_path)))
    await host.call("resume", body("c1"))
    assert (await step_open(http, host.url, busy))[0] == 200  # reopened on the new worker
    # The next checkpoint is whole again.
    assert (await host.call("prepare", body("c2")))["phase"] == "prepared"
    await host.call("resume", body("c2"))


async def test_worker_killed_mid_export_fails_that_checkpoint_whole(
    start_host: StartHost, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    host = await start_host(2, export_delay_s=2.0)
    assert host.plane is not None
    for key in owned_by(0, 2) + owned_by(1, 2):
        await step(http, host.url, key)
    assert (await host.call("prepare", body("c1")))["phase"] == "prepared"
    commit = asyncio.ensure_future(host.call("commit", body("c1", checkpoint_dir=str(tmp_path))))
    await asyncio.sleep(0.5)
    kill9(host.plane.pool.pids()["w0"])
    with pytest.raises(ParticipantUnavailable):
        await commit
    # Nothing was published for c1; a retried commit is refused too.
    assert not list(tmp_path.rglob("*.msgpack"))  # noqa: ASYNC240
    with pytest.raises((InvalidPhase, ParticipantUnavailable)):
        await host.call("commit", body("c1", checkpoint_dir=str(tmp_path)))
    await host.call("resume", body("c1"))


async def test_restore_into_a_different_worker_count_places_each_rollout_on_its_owner(
    start_host: StartHost, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    first = await start_host(2)
    rollouts = [f"r{i}" for i in range(8)]
    for i, key in enumerate(rollouts):
        for _ in range(i % 3 + 1):
            await step(http, first.url, key)
    await first.call("prepare", body("c1"))
    committed = await first.call("commit", body("c1", checkpoint_dir=str(tmp_path)))
    await first.stop()
    for workers in (3, 1):
        fresh = await start_host(workers)
        episodes = [{"rollout_id": e, "attempt": 0} for e in committed["episode_ids"]]
        restore = body("c2", checkpoint_dir=str(tmp_path), episode_ids=episodes)
        restored = await fresh.call("restore", restore)
        assert sorted(restored["restored"]) == sorted(f"{k}-a1" for k in rollouts)
        await fresh.call("resume", body("c2"))
        for i, key in enumerate(rollouts):
            status, reply = await step_open(http, fresh.url, f"{key}-a1")
            assert (status, reply["count"]) == (200, i % 3 + 2)  # continued, not restarted
            if fresh.plane is not None:
                owner = owner_index(key, workers)
                assert worker_of(fresh, reply["pid"]) == f"w{owner}"
        # The replaced attempt is fenced on whichever worker owns it.
        status, reply = await step(http, fresh.url, rollouts[0])
        assert (status, reply["error"]["code"]) == (409, "stale_attempt")
        await fresh.stop()


async def test_rollout_affine_routing_is_stable_across_a_restart(
    start_host: StartHost, http: aiohttp.ClientSession
) -> None:
    rollouts = [f"task-{i}" for i in range(12)]
    placements = []
    for _ in range(2):
        host = await start_host(3)
        placed = {}
        for key in rollouts:
            placed[key] = worker_of(host, (await step(http, host.url, key))[1]["pid"])
        placements.append(placed)
        await host.stop()
    assert placements[0] == placements[1]
    assert placements[0] == {k: f"w{owner_index(k, 3)}" for k in rollouts}
    assert len(set(placements[0].values())) == 3


async def test_a_worker_that_loses_its_host_stops_itself(start_host: StartHost) -> None:
    host = await start_host(2)
    assert host.plane is not None
    pids = list(host.plane.pool.pids().values())
    pool = host.plane.pool
    pool._stopping = True  # no respawn: we are playing a dead host
    # The host's end of every worker connection goes away, as at a kill -9.
    for _, channel in list(pool.channels.values()):
        await channel.aclose()
    codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in pool.procs.values())), 10)
    assert codes == [3, 3]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_a_stateless_server_never_blocks_and_a_shared_port_spreads(
    start_host: StartHost, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    host = await start_host(2, spreading="shared", stateless=True)
    assert host.plane is not None

    # The kernel spreads connections over the workers accepting on the one
    # port; a worker busy with CPU work leaves the next connection to another.
    async def work() -> int:
        async with http.post(f"{host.url}/work", json={"n": 50_000}) as r:
            return int((await r.json())["pid"])

    pids: set[int] = set()
    for _ in range(5):  # a loaded machine may hand one batch to one worker
        pids.update(await asyncio.gather(*(work() for _ in range(24))))
        if len(pids) == 2:
            break
    assert pids == set(host.plane.pool.pids().values())
    kill9(next(iter(pids)))
    # A lost worker of a stateless server: drained, never a blocker.
    prepared = await host.call("prepare", body("c1"))
    assert prepared["phase"] == "prepared"
    committed = await host.call("commit", body("c1", checkpoint_dir=str(tmp_path)))
    assert committed["episode_ids"] == []
    await host.call("resume", body("c1"))


async def test_a_server_whose_workers_cannot_start_fails_the_host_start() -> None:
    from ray_ckpt.gym_server.spec import ServerSpec

    # The factory raises in every worker: they exit before their hello.
    spec = ServerSpec(
        kind="environment",
        name="broken",
        factory="participants.servers.counter:no_such_factory",
        settings={"enabled": True, "control_auth_token": "t"},
        workers=2,
    )
    host = ParticipantHost(spec)
    with pytest.raises(RuntimeError, match="exited 3 times before it started"):
        await asyncio.wait_for(host._ready(), 60)
    await host.stop()
    assert host.plane is not None
    assert all(p.returncode is not None for p in host.plane.pool.procs.values())


async def test_with_checkpointing_off_workers_just_serve(http: aiohttp.ClientSession) -> None:
    from ray_ckpt.gym_server.spec import ServerSpec

    spec = ServerSpec(
        kind="resources",
        name="plain",
        factory="participants.servers.counter:counter_server",
        workers=2,
        spreading="rollout",
    )
    host = ParticipantHost(spec)
    try:
        await host._ready()
        assert host.engine is None
        key = owned_by(1, 2)[0]
        counts = [(await step(http, host.url, key))[1]["count"] for _ in range(3)]
        assert counts == [1, 2, 3]  # affine: one worker holds the rollout
        async with http.get(f"{host.url}/ng-control/v1/checkpoint/status") as r:
            assert r.status == 404  # no control plane, as without ray-ckpt
    finally:
        await host.stop()
