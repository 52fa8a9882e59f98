"""What the real-package tests share: hosting a NeMo Gym server in a
`ParticipantHost` on the shared Ray cluster, a coordinator over it, and a
real crash (kill -9 of the host's process) with a relaunch under its name.

No nemo_gym import here: this module is collected in the main venv too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import SecretStr

from coordination import connect
from coordination.client.handle import CoordinatorHandle
from ray_ckpt.gym_server.spec import ServerSpec, settings_dict
from ray_ckpt.hosting.host import relaunch_host, start_host, stop_host
from ray_ckpt.settings import CheckpointSettings

TOKEN = "nemo-real-token"
SETTINGS = CheckpointSettings(enabled=True, control_auth_token=SecretStr(TOKEN))
# What NeMo Gym's request models require around an action (minimal but valid).
CREATE_PARAMS: dict[str, Any] = {"input": "play"}


def response(text: str = "", calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A minimal `NeMoGymResponse`: one assistant message, plus function calls."""
    output: list[dict[str, Any]] = [
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
    ]
    output += calls or []
    return {
        "id": "resp_1",
        "created_at": 0,
        "model": "stand-in",
        "object": "response",
        "output": output,
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "tools": [],
    }


def spec(name: str, server: str, **options: Any) -> ServerSpec:
    return ServerSpec(
        kind="resources",
        name=name,
        factory="participants.nemo_gym:hosted",
        options={"server": server, **options},
        settings=settings_dict(SETTINGS),
    )


class Live:
    def __init__(self, handle: Any, info: dict[str, Any]) -> None:
        self.handle = handle
        self.info = info
        self.url: str = info["url"]

    def at(self, key: str, route: str) -> str:
        return f"{self.url}/ng-rollout/{key}/{route}"


class RealGym:
    """Hosts, one coordinator and an HTTP session for one test."""

    def __init__(self, namespace: str, tmp: Path, http: aiohttp.ClientSession) -> None:
        self.namespace = namespace
        self.tmp = tmp
        self.http = http
        self.hosts: list[Any] = []
        self._gym: CoordinatorHandle | None = None

    @property
    def gym(self) -> CoordinatorHandle:
        if self._gym is None:
            self._gym = connect(
                namespace=self.namespace,
                name="nemo-coordinator",
                state_dir=str(self.tmp / "coordinator"),
            )
        return self._gym

    async def start(self, server: ServerSpec, *, register: bool = True) -> Live:
        handle = start_host(server, namespace=self.namespace, get_if_exists=False)
        self.hosts.append(handle)
        live = Live(handle, await asyncio.wait_for(handle.ready.remote(), 120))
        if register:
            await asyncio.to_thread(self.gym.register_actor, server.kind, server.name)
        return live

    async def crash(self, live: Live) -> None:
        """kill -9 of the host's process: nothing is drained or flushed."""
        from ray.exceptions import RayActorError

        os.kill(live.info["pid"], signal.SIGKILL)
        with contextlib.suppress(RayActorError):
            while True:
                await asyncio.wait_for(live.handle.ready.remote(), 30)
                await asyncio.sleep(0.1)

    async def relaunch(self, server: ServerSpec) -> Live:
        handle = await relaunch_host(server, namespace=self.namespace, timeout_s=60)
        self.hosts.append(handle)
        live = Live(handle, await asyncio.wait_for(handle.ready.remote(), 120))
        await asyncio.to_thread(self.gym.register_actor, server.kind, server.name)
        return live

    async def post(self, url: str, body: Any = None) -> tuple[int, Any]:
        async with self.http.post(url, json={} if body is None else body) as resp:
            return resp.status, await resp.json()

    async def ok(self, url: str, body: Any = None) -> Any:
        status, reply = await self.post(url, body)
        assert status == 200, (url, status, reply)
        return reply

    async def close(self) -> None:
        import ray

        for handle in self.hosts:
            with contextlib.suppress(Exception):
                await stop_host(handle, timeout_s=10)
        if self._gym is not None:
            with contextlib.suppress(Exception):
                ray.kill(self._gym.actor, no_restart=True)
