"""A restored multi-worker host losing a worker (a real `kill -9` of a real
worker process) before the restored episodes it held were continued.

The episodes a worker held are gone with it, although the restore reported
them restored: the restore's resume is refused (`restored_state_lost`), and
whenever the loss happens, a late call of such an attempt is refused
`stale_attempt` instead of silently starting the rollout over."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from ray_ckpt.errors import RestoredStateLost
from ray_ckpt.hosting.host import ParticipantHost
from tests.workers.conftest import StartHost, body, kill9, step, step_open
from tests.workers.test_host_workers import owned_by, wait_for


async def restored_host(
    start_host: StartHost, http: aiohttp.ClientSession, tmp_path: Path
) -> tuple[ParticipantHost, str, str]:
    """A fresh two-worker host restored from a checkpoint holding one rollout
    per worker, two steps in; returns (host, w0's rollout, w1's rollout)."""
    [on0], [on1] = owned_by(0, 2), owned_by(1, 2)
    first = await start_host(2)
    for key in (on0, on1):
        for _ in range(2):
            assert (await step(http, first.url, key))[0] == 200
    assert (await first.call("prepare", body("c1")))["phase"] == "prepared"
    await first.call("commit", body("c1", checkpoint_dir=str(tmp_path)))
    await first.stop()
    host = await start_host(2)
    episodes = [{"rollout_id": k, "attempt": 0} for k in (on0, on1)]
    restored = await host.call(
        "restore", body("x1", checkpoint_dir=str(tmp_path), episode_ids=episodes)
    )
    assert sorted(restored["restored"]) == sorted([f"{on0}-a1", f"{on1}-a1"])
    return host, on0, on1


async def kill_and_replace(host: ParticipantHost, wid: str) -> None:
    assert host.plane is not None
    pool = host.plane.pool
    old = pool.pids()[wid]
    kill9(old)
    await wait_for(lambda: pool.pids().get(wid) not in (None, old))


def code(reply: dict[str, Any]) -> str:
    return str(reply["error"]["code"])


async def test_a_worker_killed_between_install_and_resume_fails_the_resume(
    start_host: StartHost, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    host, on0, on1 = await restored_host(start_host, http, tmp_path)
    await kill_and_replace(host, "w1")
    with pytest.raises(RestoredStateLost, match=f"w1: {on1}-a1"):
        await host.call("resume", body("x1"))
    assert host.engine is not None
    assert host.engine.status()["phase"] == "restored"
    # Whatever happens next, the lost attempt never runs from nothing.
    status, reply = await step(http, host.url, f"{on1}-a1")
    assert (status, code(reply)) == (409, "stale_attempt")
    # The coordinator's undo: retire the restored attempts, then resume.
    retired = [{"rollout_id": k, "attempt": 1} for k in (on0, on1)]
    await host.call("retire", body("x1", episode_ids=retired))
    assert (await host.call("resume", body("x1")))["phase"] == "idle"
    status, reply = await step_open(http, host.url, f"{on1}-a1")
    assert (status, code(reply)) == (409, "stale_attempt")
    status, reply = await step_open(http, host.url, f"{on1}-a2")
    assert (status, reply["count"]) == (200, 1)  # started over, knowingly


async def test_a_worker_killed_after_the_resume_fences_the_restored_attempt_it_held(
    start_host: StartHost, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    host, on0, on1 = await restored_host(start_host, http, tmp_path)
    assert (await host.call("resume", body("x1")))["phase"] == "idle"
    await kill_and_replace(host, "w1")  # before the first call of r-a1
    status, reply = await step_open(http, host.url, f"{on1}-a1")
    assert (status, code(reply)) == (409, "stale_attempt")
    # The surviving worker's restored episode continues its count.
    status, reply = await step_open(http, host.url, f"{on0}-a1")
    assert (status, reply["count"]) == (200, 3)
