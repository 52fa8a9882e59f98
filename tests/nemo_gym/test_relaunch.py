"""`relaunch_host`, the public crash-recovery helper: a fresh host under the
name of one killed by kill -9 (whose name Ray keeps until it is released),
never over a live one."""

from __future__ import annotations

import os
import signal

import pytest
from pydantic import SecretStr

from ray_ckpt.gym_server.spec import ServerSpec, settings_dict
from ray_ckpt.hosting.host import relaunch_host, start_host, stop_host
from ray_ckpt.settings import CheckpointSettings
from tests.actors import until_dead

pytestmark = pytest.mark.ray


def spec() -> ServerSpec:
    settings = CheckpointSettings(enabled=True, control_auth_token=SecretStr("relaunch"))
    return ServerSpec(
        kind="environment",
        name="relaunched",
        factory="tests.servers:aiohttp_server",
        settings=settings_dict(settings),
    )


async def test_relaunch_takes_a_dead_hosts_name_and_refuses_a_live_one(namespace: str) -> None:
    first = start_host(spec(), namespace=namespace, get_if_exists=False)
    info = await first.ready.remote()
    os.kill(info["pid"], signal.SIGKILL)
    await until_dead(first)
    # The dead host still holds its name: a plain start cannot take it.
    with pytest.raises(ValueError, match=r"already taken|exists"):
        start_host(spec(), namespace=namespace, get_if_exists=False)
    second = await relaunch_host(spec(), namespace=namespace, timeout_s=30)
    try:
        again = await second.ready.remote()
        assert again["pid"] != info["pid"]
        assert (await second.status.remote())["phase"] == "idle"
        with pytest.raises(ValueError, match="alive"):
            await relaunch_host(spec(), namespace=namespace, timeout_s=1)
        assert (await second.ready.remote())["pid"] == again["pid"]
    finally:
        await stop_host(second, timeout_s=10)
