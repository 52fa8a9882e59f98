"""A hung worker (SIGSTOP: alive, silent) is lost after the silence bound,
killed so it can never serve again, and replaced."""

from __future__ import annotations

import asyncio
import os
import signal

from ray_ckpt.gym_server.serving import bind_socket
from ray_ckpt.workers.plane import WorkerPlane
from tests.workers.conftest import spec


async def test_a_silent_worker_is_lost_killed_and_replaced() -> None:
    shared = bind_socket("127.0.0.1", 0)
    # Workers heartbeat every second: a bound of one heartbeat lost a healthy
    # worker too whenever the loaded CI machine delayed one; four heartbeats
    # tell a stopped worker from a slow one.
    plane = WorkerPlane(spec(2), shared, silence_s=4.0)
    try:
        await plane.start(None)
        participant, table, pool = plane.participant, plane.table, plane.pool
        participant.close_admission()
        async with asyncio.timeout(10):
            while not participant.ready():
                await pool.wait_change()
        hung = pool.pids()["w1"]
        proc = pool.procs[1]
        os.kill(hung, signal.SIGSTOP)
        async with asyncio.timeout(10):
            while "worker-lost:w1" not in table.blockers():
                await pool.wait_change()
        assert not participant.ready()
        assert await asyncio.wait_for(proc.wait(), 5) == -signal.SIGKILL
        # The replacement starts closed and reports; the loss still blocks
        # until admission reopens.
        async with asyncio.timeout(10):
            while pool.pids().get("w1") in (None, hung) or len(table.current()) < 2:
                await pool.wait_change()
        assert table.blockers() == ["worker-lost:w1"]
        assert table.current()["w1"].generation == table.generation
        participant.open_admission()
        participant.close_admission()
        async with asyncio.timeout(10):
            while not participant.ready():
                await pool.wait_change()
    finally:
        await plane.stop()
        shared.close()
