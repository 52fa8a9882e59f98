"""Sidecar mode: a Gym server in its own OS process, with a colocated forwarder.

In NeMo RL the Gym servers are subprocesses of its `NemoGym` actor, so they
cannot run inside a `ParticipantHost`.  The server installs the integration
in-process (`install_sidecar` for aiohttp apps, `wrap_asgi_sidecar` for ASGI
apps): the engine, its lease watcher and the control routes on the
server's own port.  A `SidecarHost` actor on the same node exposes the same
Ray methods as a `ParticipantHost` and forwards each call over the reserved
control pool.

Two leases: the host holds the coordinator's (the last forwarded deadline
plus `lease_grace_seconds`); while that lease runs and a checkpoint is open it
keeps renewing the server's, every half of what the server reports is left.
A server may therefore run with a short grace: if the host dies, the renewals
stop, the server's own lease lapses and it resumes by itself.

The host reports the server's metrics as a `ParticipantHost` does (the
server's process is outside Ray): each forwarded control call, timed here
with its outcome; the writes in flight the server's replies and status say;
and a lease expiry when the coordinator's lease held here lapses (the server
then resumes by itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from ray_ckpt.clock import SYSTEM_CLOCK, Clock
from ray_ckpt.control.asgi import ASGIApp, ControlASGIMiddleware, Message, Receive, Scope, Send
from ray_ckpt.control.client import ControlClient
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.control.protocol import Participant
from ray_ckpt.control.routes import maybe_install_control_routes
from ray_ckpt.control.wire import CONTROL_OPERATIONS
from ray_ckpt.errors import CheckpointError, NotFound, ParticipantUnavailable
from ray_ckpt.gym_server.spec import NamedControlOps, ServerSpec, current_node_id
from ray_ckpt.hosting.metrics import HostMetrics
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.workers.detect import refuse_unmanaged_workers

log = logging.getLogger(__name__)

# Renewals never come closer together than this, whatever the server reports.
MIN_RENEW_INTERVAL_S = 0.05
# How far ahead the first renewal sets its deadline, before the server's lease is known.
FIRST_RENEW_AHEAD_S = 1.0
# After a failed renewal that may heal (server briefly unreachable).
RENEW_RETRY_S = 0.5
_OPENING_OPS = frozenset({"prepare", "renew", "commit", "restore"})


# --- in the server's process ----------------------------------------------------


def install_sidecar(
    app: web.Application,
    participant: Participant,
    settings: CheckpointSettings,
    *,
    instance: str,
    clock: Clock = SYSTEM_CLOCK,
) -> ParticipantEngine | None:
    """Mount the control routes on the server's aiohttp app; None when disabled.

    The lease watcher runs for the app's lifetime (`cleanup_ctx`).
    """
    if not settings.enabled:
        return None
    engine = ParticipantEngine(
        participant, instance=instance, settings=settings, clock=clock
    )
    maybe_install_control_routes(app, engine, settings)

    async def lifecycle(_app: web.Application) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.aclose()

    app.cleanup_ctx.append(lifecycle)
    return engine


class _EngineLifecycle:
    """Starts the lease watcher on the first ASGI call; closes it at lifespan shutdown.

    Any call that can open a lease (a control call) passes through here first,
    so the watcher always runs before a lease exists, with or without lifespan.
    """

    def __init__(self, app: ASGIApp, engine: ParticipantEngine) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.engine.start()
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def watched() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.engine.aclose()
            return message

        await self.app(scope, watched, send)


def wrap_asgi_sidecar(
    app: ASGIApp,
    participant: Participant,
    settings: CheckpointSettings,
    *,
    instance: str,
    clock: Clock = SYSTEM_CLOCK,
) -> tuple[ASGIApp, ParticipantEngine | None]:
    """The ASGI app with the control routes in front (unchanged when disabled)."""
    if not settings.enabled:
        return app, None
    engine = ParticipantEngine(
        participant, instance=instance, settings=settings, clock=clock
    )
    front = ControlASGIMiddleware.from_settings(app, engine, settings)
    return _EngineLifecycle(front, engine), engine


# --- the colocated forwarder (a Ray actor) ------------------------------------------


class SidecarHost(NamedControlOps):
    """Forwards control calls to a sidecar server; same methods as `ParticipantHost`."""

    def __init__(self, spec: ServerSpec, clock: Clock = SYSTEM_CLOCK) -> None:
        if spec.url is None:
            raise ValueError(f"{spec!r} has no sidecar url")
        self.spec = spec
        self.settings = spec.checkpoint_settings()
        if not self.settings.enabled:
            raise ValueError("a sidecar host forwards control calls: checkpointing must be on")
        self.url = spec.url.rstrip("/")
        self._clock = clock
        self.client = ControlClient.from_settings(self.url, self.settings, clock=clock)
        self._open: str | None = None  # the checkpoint open on the server, as far as we know
        self._lease_until = 0.0  # the coordinator's lease, held here
        self._next_renew = 0.0
        self._ahead = FIRST_RENEW_AHEAD_S
        self._wake = asyncio.Event()
        self._stopped = False
        self.metrics = HostMetrics(spec.kind)
        self._writes_in_flight = 0  # as the server last said
        # Ray runs a sync __init__ of an async actor on the actor's loop.
        self._renewer = asyncio.get_running_loop().create_task(self._renew_loop())

    # --- Ray methods -------------------------------------------------------------
    async def ready(self) -> dict[str, Any]:
        """Where the server listens; also proves it answers control calls."""
        self._check_running()
        status = await self.client.status()
        await refuse_unmanaged_workers(self.client, status, what=self.spec.actor_name)
        parts = urlsplit(self.url)
        return {
            "kind": self.spec.kind,
            "name": self.spec.name,
            "mode": "sidecar",
            "url": self.url,
            "host": parts.hostname,
            "port": parts.port,
            "node_id": current_node_id(),
            "pid": os.getpid(),
            "checkpointing": True,
        }

    async def status(self) -> dict[str, Any]:
        self._check_running()
        return self._noted(await self.client.status())

    async def call(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        self._check_running()
        if op == "status":
            return self._noted(await self.client.status())
        if op not in CONTROL_OPERATIONS:
            raise NotFound(f"unknown control operation {op!r}")
        start = self._clock.now()
        outcome = "failed"
        try:
            reply = self._noted(await self.client.call(op, body))
            outcome = "ok"
        finally:
            self.metrics.call_done(op, self._clock.now() - start, outcome, self._writes_in_flight)
        self._track(op, body)
        return reply

    def _noted(self, reply: dict[str, Any]) -> dict[str, Any]:
        """Keep the server's count of writes in flight, where a reply says it."""
        writes = reply.get("writes_in_flight")
        if isinstance(writes, int) and not isinstance(writes, bool):
            self._writes_in_flight = writes
        return reply

    async def stop(self) -> dict[str, Any]:
        """Stop forwarding and renewing; the server process is not ours to stop."""
        if self._stopped:
            return {"stopped": True, "idempotent": True}
        self._stopped = True
        self._renewer.cancel()
        await asyncio.gather(self._renewer, return_exceptions=True)
        await self.client.aclose()
        return {"stopped": True, "idempotent": False}

    # --- lease keeping -----------------------------------------------------------
    def _check_running(self) -> None:
        if self._stopped:
            raise ParticipantUnavailable(f"{self.spec.actor_name} is stopped")

    def _track(self, op: str, body: dict[str, Any]) -> None:
        cid = body.get("checkpoint_id")
        deadline = body.get("deadline_ts")
        if not isinstance(cid, str) or not isinstance(deadline, int | float):
            return
        if op == "resume":
            if self._open == cid:
                self._open = None
        elif op in _OPENING_OPS:
            if self._open != cid:
                self._open, self._lease_until = cid, 0.0
            self._lease_until = max(self._lease_until, deadline + self.settings.lease_grace_seconds)
            self._next_renew = self._clock.now()  # learn the server's lease now
        self._wake.set()

    async def _renew_loop(self) -> None:
        while True:
            self._wake.clear()
            now = self._clock.now()
            cid = self._open
            if cid is not None and now >= self._lease_until:
                log.warning("%s: coordinator lease of %s lapsed", self.spec.actor_name, cid)
                self.metrics.lease_expired()
                self._open = cid = None
            if cid is None:
                await self._wake.wait()
                continue
            if now < self._next_renew:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._next_renew - now):
                        await self._wake.wait()
                continue
            await self._renew_once(cid, now)

    async def _renew_once(self, cid: str, now: float) -> None:
        deadline = min(now + self._ahead, self._lease_until)
        try:
            reply = await self.client.call("renew", {"checkpoint_id": cid, "deadline_ts": deadline})
        except CheckpointError as exc:
            if exc.retryable:
                self._next_renew = self._clock.now() + RENEW_RETRY_S
                return
            # The server moved on (resumed by itself, or another checkpoint): stop.
            log.warning("%s: renew of %s refused: %s", self.spec.actor_name, cid, exc)
            if self._open == cid:
                self._open = None
            return
        expires = reply.get("lease_expires_at")
        now = self._clock.now()
        if isinstance(expires, int | float):
            half = max((expires - now) / 2, MIN_RENEW_INTERVAL_S)
            self._ahead = half
            self._next_renew = now + half
        else:
            self._next_renew = now + FIRST_RENEW_AHEAD_S
