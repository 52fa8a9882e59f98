"""A multi-worker `ParticipantHost` as a Ray actor: its workers die with it."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from ray_ckpt.gym_server.spec import ServerSpec
from ray_ckpt.hosting.host import start_host, stop_host

pytestmark = [pytest.mark.ray]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its dead parent's reaper) is gone too.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


async def test_workers_stop_themselves_when_their_host_is_killed(namespace: str) -> None:
    spec = ServerSpec(
        kind="resources",
        name="counter-w",
        factory="participants.servers.counter:counter_server",
        settings={"enabled": True, "control_auth_token": "tok"},
        workers=2,
        spreading="rollout",
    )
    handle = start_host(spec, namespace=namespace)
    try:
        info = await asyncio.wait_for(handle.ready.remote(), 60)
        assert info["workers"] == 2
        status = await handle.status.remote()
        pids = list(status["workers"]["pids"].values())
        assert len(pids) == 2
        assert all(_alive(p) for p in pids)
        os.kill(info["pid"], signal.SIGKILL)  # the host actor's process, no drain
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        assert not any(_alive(p) for p in pids)
    finally:
        await stop_host(handle, timeout_s=5)
