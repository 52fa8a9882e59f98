"""A fleet whose processes died by kill -9 is relaunched under the same names."""

from __future__ import annotations

import asyncio
import os
import signal

import psutil
import pytest
from ray.exceptions import RayActorError

from participants.fleet import FleetConfig, launch_fleet

pytestmark = pytest.mark.ray


async def test_relaunch_after_kill_9_reuses_the_names(namespace: str) -> None:
    config = FleetConfig(namespace=namespace, token="relaunch-token")
    fleet = await launch_fleet(config)
    fresh = None
    try:
        pids = [info["pid"] for info in fleet.info.values()]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for pid in pids:
            if psutil.pid_exists(pid):
                psutil.Process(pid).wait(timeout=10)
        for handle in fleet.hosts.values():
            with pytest.raises(RayActorError):
                await asyncio.wait_for(handle.ready.remote(), 30)
        # The dead hosts still hold their names (the driver holds handles).
        fresh = await launch_fleet(config)
        assert fresh.names == fleet.names
        assert fresh.info.keys() == fleet.info.keys()
        assert not set(pids) & {i["pid"] for i in fresh.info.values()}
        # A live fleet's names are not taken over.
        with pytest.raises(ValueError, match="alive"):
            await launch_fleet(config)
    finally:
        if fresh is not None:
            await fresh.stop()
        fleet.kill()
