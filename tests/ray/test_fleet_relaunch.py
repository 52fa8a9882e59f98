"""A fleet whose processes died by kill -9 is relaunched under the same names."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import psutil
import pytest
from ray.exceptions import RayActorError

from coordination.engine.baseline import identity
from coordination.engine.order import Member
from coordination.reach.hosts import RayHost
from participants.fleet import FleetConfig, launch_fleet

pytestmark = pytest.mark.ray


def actor_identity(handle: object) -> str | None:
    """What the coordinator's Gym baseline records for a Ray host."""
    return identity(RayHost(Member(kind="environment", name="h"), handle))


async def test_relaunch_after_kill_9_reuses_the_names(namespace: str) -> None:
    config = FleetConfig(namespace=namespace, token="relaunch-token")
    fleet = await launch_fleet(config)
    fresh = None
    try:
        before = {name: actor_identity(h) for name, h in fleet.hosts.items()}
        assert all(before.values())
        assert len(set(before.values())) == len(before)
        pids = [info["pid"] for info in fleet.info.values()]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):  # already gone
                psutil.Process(pid).wait(timeout=10)
        for handle in fleet.hosts.values():
            with pytest.raises(RayActorError):
                await asyncio.wait_for(handle.ready.remote(), 30)
        # The dead hosts still hold their names (the driver holds handles).
        fresh = await launch_fleet(config)
        assert fresh.names == fleet.names
        assert fresh.info.keys() == fleet.info.keys()
        assert not set(pids) & {i["pid"] for i in fresh.info.values()}
        # Same names, other actors: the baseline tells every one apart.
        after = {name: actor_identity(h) for name, h in fresh.hosts.items()}
        assert after.keys() == before.keys()
        assert all(after.values())
        assert not set(after.values()) & set(before.values())
        assert after == {name: actor_identity(h) for name, h in fresh.hosts.items()}
        # A live fleet's names are not taken over.
        with pytest.raises(ValueError, match="alive"):
            await launch_fleet(config)
    finally:
        if fresh is not None:
            await fresh.stop()
        fleet.kill()
