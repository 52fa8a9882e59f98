"""A multi-worker host's part: the pool, the aggregate participant, the control port.

`ParticipantHost` builds one `WorkerPlane` when its spec asks for more than
one worker.  The host itself serves no data request: it owns the shared
listening socket (inherited by every worker), the one engine (driven by
the Ray methods, and over HTTP through a private loopback control port that
every worker forwards control paths to), and the worker table.
"""

from __future__ import annotations

import socket
from typing import Any

from aiohttp import web

from ray_ckpt.clock import SYSTEM_CLOCK, Clock
from ray_ckpt.control.routes import ControlTarget, maybe_install_control_routes
from ray_ckpt.gym_server.serving import Serving, bind_socket, serve_app, socket_address
from ray_ckpt.gym_server.spec import ServerSpec
from ray_ckpt.workers.aggregate import WorkersParticipant
from ray_ckpt.workers.pool import WorkerPool
from ray_ckpt.workers.tracking import WorkerTable

# A worker silent this long (no report, no heartbeat) is lost.
SILENCE_S = 10.0


class _StatusWithWorkers:
    """The engine as the control routes see it, with `workers` in status:
    the sign, for discovery, that this server's workers are managed."""

    def __init__(self, target: ControlTarget, plane: WorkerPlane) -> None:
        self._target = target
        self._plane = plane

    async def handle(self, op: str, body: bytes | dict[str, Any]) -> dict[str, Any]:
        if op == "status":
            return self.status()
        return await self._target.handle(op, body)

    def status(self) -> dict[str, Any]:
        return {**self._target.status(), "workers": self._plane.summary()}


class WorkerPlane:
    def __init__(
        self,
        spec: ServerSpec,
        shared: socket.socket,
        *,
        clock: Clock = SYSTEM_CLOCK,
        silence_s: float = SILENCE_S,
    ) -> None:
        self.spec = spec
        self.settings = spec.checkpoint_settings()
        self.table = WorkerTable(spec.workers, clock, silence_s=silence_s)
        self._control_sock: socket.socket | None = None
        self._control: Serving | None = None
        control_url: str | None = None
        if self.settings.enabled:
            self._control_sock = bind_socket("127.0.0.1", 0)
            host, port = socket_address(self._control_sock)
            control_url = f"http://{host}:{port}"
        # The host's own control port: control calls never queue behind data work.
        self.control_url = control_url
        self.pool = WorkerPool(spec, self.table, shared, control_url=control_url)
        self.participant = WorkersParticipant(spec.kind, self.pool, stateless=spec.stateless)

    async def start(self, target: ControlTarget | None, timeout_s: float = 60.0) -> None:
        """Serve the control port (if checkpointing), then start every worker."""
        if target is not None and self._control_sock is not None:
            app = web.Application()
            maybe_install_control_routes(app, _StatusWithWorkers(target, self), self.settings)
            self._control = await serve_app(app, self._control_sock, drain_s=1.0)
        await self.pool.start(timeout_s)

    def summary(self) -> dict[str, Any]:
        return {
            **self.table.summary(),
            "spreading": self.spec.spreading,
            "stateless": self.spec.stateless,
            "pids": self.pool.pids(),
        }

    async def stop(self) -> None:
        await self.pool.stop()
        await self.participant.aclose()
        if self._control is not None:
            await self._control.stop()
        if self._control_sock is not None:
            self._control_sock.close()
