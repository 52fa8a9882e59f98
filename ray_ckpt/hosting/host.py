"""`ParticipantHost`: the colocated Ray actor of one Gym server.

A Gym server is reached by its checkpoint engine through one of three
transports; the engine (phase machine, fencing, lease) is the same code in
all of them, only the way calls reach it differs:

- **Hosted** (`ParticipantHost`): the Gym app, aiohttp or ASGI (FastAPI),
  runs inside this actor's event loop, with the bearer-protected control
  routes on the same port.  The coordinator calls the actor's methods
  (`prepare`, `commit`, ...) with object refs; they call the very engine
  the HTTP routes call.
- **Sidecar** (`ray_ckpt.hosting.sidecar.SidecarHost`): the Gym server is its own OS
  process with the integration installed in-process; the colocated actor has
  the same methods and forwards each over loopback HTTP through the reserved
  control pool, and renews the server's lease while a checkpoint is open.  If
  the actor dies, the server's lease lapses and it resumes by itself.
- **HTTP only**: a Gym server on another cluster is driven by URL and token
  alone (`ray_ckpt.control.client.ControlClient`); no actor is involved.

Ray restarts an actor by re-running `__init__` only, so `__init__` does the
whole setup: it loads the server, builds the engine, mounts the routes and
binds the socket synchronously, then schedules serving and the lease watcher
on the actor's loop; every method awaits that start first.  The default is
`max_restarts=0`: a replacement host is a fresh process that accepts exactly
one `restore` before it serves (the engine enforces this).
"""

from __future__ import annotations

import asyncio
import logging
import os
from functools import cache
from typing import Any

from aiohttp import web

from ray_ckpt.control.asgi import ASGIApp, ControlASGIMiddleware
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.control.protocol import Participant
from ray_ckpt.control.receipt_ops import held_results
from ray_ckpt.control.routes import maybe_install_control_routes
from ray_ckpt.control.wire import CONTROL_OPERATIONS
from ray_ckpt.errors import CheckpointError, NotFound, ParticipantUnavailable
from ray_ckpt.gym_server.serving import (
    DEFAULT_DRAIN_S,
    Serving,
    bind_socket,
    serve_app,
    socket_address,
)
from ray_ckpt.gym_server.spec import (
    GymServer,
    NamedControlOps,
    ServerSpec,
    current_node_id,
    load_server,
)
from ray_ckpt.hosting.metrics import HostMetrics
from ray_ckpt.workers.plane import WorkerPlane

log = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENCY = 1000
# How often a host samples its held results for the metrics (Ray reports
# every 10 s by default).
HELD_REPORT_S = 1.0


class ParticipantHost(NamedControlOps):
    """Hosts one Gym server and its participant engine (use via `start_host`)."""

    def __init__(self, spec: ServerSpec, drain_s: float = DEFAULT_DRAIN_S) -> None:
        self.spec = spec
        self.settings = spec.checkpoint_settings()
        self._drain_s = drain_s
        self._sock = bind_socket(spec.host, spec.port)
        self.host, self.port = socket_address(self._sock)
        # With several workers the server runs in worker processes that
        # inherit the socket; this actor keeps the one control plane.
        self.plane: WorkerPlane | None = None
        self.server: GymServer | None = None
        participant: Participant
        if spec.workers > 1:
            self.plane = WorkerPlane(spec, self._sock)
            participant = self.plane.participant
        else:
            self.server = load_server(spec)
            participant = self.server.participant
        # With checkpointing off there is no engine and no route: the
        # server behaves exactly as it would without ray-ckpt.
        self.engine: ParticipantEngine | None = None
        app: web.Application | ASGIApp | None = None if self.server is None else self.server.app()
        if self.settings.enabled:
            self.engine = ParticipantEngine(
                participant, instance=spec.name, settings=self.settings
            )
            # Inside the Ray actor: its calls, writes and lease expiries as Ray metrics.
            self.metrics: HostMetrics | None = HostMetrics(spec.kind)
            self.engine.observer = self.metrics
            if self.server is not None:
                self.server.attach(self.engine)
            if isinstance(app, web.Application):
                maybe_install_control_routes(app, self.engine, self.settings)
            elif app is not None:
                app = ControlASGIMiddleware.from_settings(app, self.engine, self.settings)
        else:
            self.metrics = None
        self._reporting: asyncio.Task[None] | None = None
        self._app = app
        self._serving: Serving | None = None
        self._stopped = False
        # Ray runs a sync __init__ of an async actor on the actor's loop.
        self._started = asyncio.get_running_loop().create_task(self._start())

    async def _start(self) -> None:
        if self._app is not None:
            self._serving = await serve_app(self._app, self._sock, drain_s=self._drain_s)
        if self.engine is not None:
            self.engine.start()
            if held_results(self.engine.participant) is not None and self.metrics is not None:
                self._reporting = asyncio.get_running_loop().create_task(
                    _report_held(self.engine, self.metrics)
                )
        if self.plane is not None:
            await self.plane.start(self.engine)
        log.info("%s serving on %s", self.spec.actor_name, self.url)

    async def _ready(self) -> None:
        if self._stopped:
            raise ParticipantUnavailable(f"{self.spec.actor_name} is stopped")
        await asyncio.shield(self._started)

    def _controller(self) -> ParticipantEngine:
        if self.engine is None:
            raise NotFound(f"checkpointing is disabled on {self.spec.actor_name}")
        return self.engine

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # --- Ray methods ---------------------------------------------------------
    async def ready(self) -> dict[str, Any]:
        """Where the server listens (port 0 resolved) and where this actor runs."""
        await self._ready()
        return {
            "kind": self.spec.kind,
            "name": self.spec.name,
            "mode": "hosted",
            "url": self.url,
            "host": self.host,
            "port": self.port,
            "node_id": current_node_id(),
            "pid": os.getpid(),
            "checkpointing": self.engine is not None,
            "workers": self.spec.workers,
            "spreading": self.spec.spreading,
        }

    async def server_spec(self) -> ServerSpec:
        """The spec this host was started from (`ray-ckpt restore --relaunch`
        starts a fresh host from it)."""
        return self.spec

    async def status(self) -> dict[str, Any]:
        await self._ready()
        status = self._controller().status()
        if self.plane is not None:
            status["workers"] = self.plane.summary()
        return status

    async def call(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """One control operation by name (the same as the named methods)."""
        await self._ready()
        if op != "status" and op not in CONTROL_OPERATIONS:
            raise NotFound(f"unknown control operation {op!r}")
        return await self._controller().handle(op, body)

    async def stop(self) -> dict[str, Any]:
        """Graceful stop (idempotent): drain data routes, close sockets, then engine, server."""
        if self._stopped:
            return {"stopped": True, "idempotent": True}
        self._stopped = True
        if self._reporting is not None:
            self._reporting.cancel()
        try:
            await self._started
        except Exception:
            log.warning("%s never started serving", self.spec.actor_name, exc_info=True)
        if self._serving is not None:
            await self._serving.stop()
        if self.plane is not None:
            await self.plane.stop()
        self._sock.close()
        if self.engine is not None:
            await self.engine.aclose()
        if self.server is not None:
            await self.server.aclose()
        return {"stopped": True, "idempotent": False}


async def _report_held(engine: ParticipantEngine, metrics: HostMetrics) -> None:
    """The held results as gauges: they change on the data plane (a `/run`
    finishing, an ack), not only on control calls, so they are sampled."""
    while True:
        held = held_results(engine.participant)
        if held is not None:
            metrics.held(len(held), held.bytes)
        await asyncio.sleep(HELD_REPORT_S)


# --- placement ------------------------------------------------------------------


@cache
def _remote(cls: type) -> Any:
    import ray

    return ray.remote(cls)


def host_class(spec: ServerSpec) -> type:
    if spec.url is not None:
        from ray_ckpt.hosting.sidecar import SidecarHost

        return SidecarHost
    return ParticipantHost


def host_actor_options(
    spec: ServerSpec,
    *,
    namespace: str,
    node_id: str | None = None,
    get_if_exists: bool = True,
    max_restarts: int = 0,
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    lifetime: str | None = None,
) -> dict[str, Any]:
    """Ray actor options: named `<kind>/<name>` in `namespace`, pinned to a node.
    `lifetime="detached"`: it outlives the process that started it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not namespace:
        raise ValueError("hosts need an explicit Ray namespace")
    return {
        "name": spec.actor_name,
        "namespace": namespace,
        "get_if_exists": get_if_exists,
        "num_cpus": 0,
        "max_concurrency": max_concurrency,
        "max_restarts": max_restarts,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(
            node_id=node_id or current_node_id(), soft=False
        ),
        **({"lifetime": lifetime} if lifetime is not None else {}),
    }


def start_host(
    spec: ServerSpec,
    *,
    namespace: str,
    node_id: str | None = None,
    get_if_exists: bool = True,
    **options: Any,
) -> Any:
    """Create (or, with `get_if_exists`, find) the host actor; returns its handle.

    Default node: the caller's.  Await `handle.ready.remote()` for its address.
    """
    opts = host_actor_options(
        spec, namespace=namespace, node_id=node_id, get_if_exists=get_if_exists, **options
    )
    return _remote(host_class(spec)).options(**opts).remote(spec)


def get_host(kind: str, name: str, *, namespace: str) -> Any:
    """The handle of a running host (raises ValueError if there is none)."""
    import ray

    from ray_ckpt.gym_server.spec import actor_name

    return ray.get_actor(actor_name(kind, name), namespace=namespace)


async def relaunch_host(
    spec: ServerSpec,
    *,
    namespace: str,
    node_id: str | None = None,
    timeout_s: float = 30.0,
    **options: Any,
) -> Any:
    """Start a fresh host under the name of one that died; returns its handle.

    For crash recovery: the replacement of a dead host needs its name, and a
    name freed by `ray.kill` takes a moment to become free, while a host
    whose process died by itself (kill -9) keeps its name until it is
    `ray.kill`ed.  This waits (up to `timeout_s`) until the name is free,
    releasing a dead holder, and refuses (`ValueError`) to replace a host
    that still answers.  The new host is fresh: restore into it next.
    """
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout_s
    while True:
        try:
            return start_host(
                spec, namespace=namespace, node_id=node_id, get_if_exists=False, **options
            )
        except ValueError:
            if loop.time() >= give_up:
                raise
        await _release_if_dead(spec, namespace)
        await asyncio.sleep(0.1)


async def _release_if_dead(spec: ServerSpec, namespace: str) -> None:
    import ray
    from ray.exceptions import RayActorError

    try:
        old = ray.get_actor(spec.actor_name, namespace=namespace)
    except ValueError:
        return  # already free (or about to be)
    try:
        await asyncio.wait_for(old.ready.remote(), 5.0)
    except RayActorError:
        ray.kill(old, no_restart=True)
        return
    except (TimeoutError, CheckpointError):
        return  # starting, busy or stopping: try the name again later
    raise ValueError(f"{spec.actor_name} is alive in namespace {namespace!r}: not replacing it")


async def stop_host(handle: Any, *, timeout_s: float = 30.0) -> None:
    """Graceful stop, then end the actor process (dead or stuck hosts are killed)."""
    import ray

    try:
        await asyncio.wait_for(handle.stop.remote(), timeout_s)
    except ray.exceptions.RayActorError:
        pass  # already dead: nothing to drain
    except (TimeoutError, CheckpointError):
        log.warning("host did not stop gracefully; killing it", exc_info=True)
    ray.kill(handle, no_restart=True)
