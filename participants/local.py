"""The reference fleet in the current event loop, without Ray (tests, quick demos).

Each server is built by its factory exactly as a `ParticipantHost` builds it,
gets its own `ParticipantEngine` and control routes, and listens on a
loopback port; `LocalFleet.engines` drives the phases directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from participants.fleet import KIND_ORDER, START_ORDER, FleetConfig, factory_options
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.control.routes import maybe_install_control_routes
from ray_ckpt.gym_server.serving import Serving, bind_socket, serve_app, socket_address
from ray_ckpt.gym_server.spec import GymServer, ServerSpec, load_server, settings_dict


@dataclass
class LocalServer:
    server: GymServer
    engine: ParticipantEngine | None
    url: str
    serving: Serving

    async def stop(self) -> None:
        await self.serving.stop()
        if self.engine is not None:
            await self.engine.aclose()
        await self.server.aclose()


@dataclass
class LocalFleet:
    servers: dict[str, LocalServer] = field(default_factory=dict)
    stopped: bool = False

    @property
    def urls(self) -> dict[str, str]:
        return {kind: s.url for kind, s in self.servers.items()}

    @property
    def engines(self) -> dict[str, ParticipantEngine]:
        return {k: s.engine for k, s in self.servers.items() if s.engine is not None}

    def server(self, kind: str) -> Any:
        return self.servers[kind].server

    async def stop(self) -> None:
        """Stop in call order (callers first); idempotent.  The servers stay
        inspectable (stats, participants) after they stopped."""
        if self.stopped:
            return
        self.stopped = True
        for kind in KIND_ORDER:
            if kind in self.servers:
                await self.servers[kind].stop()


async def start_local_server(
    kind: str,
    factory: str,
    name: str,
    config: FleetConfig,
    *,
    drain_s: float = 0.2,
    **options: Any,
) -> LocalServer:
    settings = config.settings()
    spec = ServerSpec(
        kind=kind, name=name, factory=factory, options=options, settings=settings_dict(settings)
    )
    server = load_server(spec)
    app = server.app()
    if not isinstance(app, web.Application):
        raise TypeError("the reference servers are aiohttp apps")
    engine = None
    if settings.enabled:
        engine = ParticipantEngine(server.participant, instance=name, settings=settings)
        server.attach(engine)
        maybe_install_control_routes(app, engine, settings)
        engine.start()
    sock = bind_socket("127.0.0.1", 0)
    host, port = socket_address(sock)
    serving = await serve_app(app, sock, drain_s=drain_s)
    return LocalServer(server, engine, f"http://{host}:{port}", serving)


async def start_local_fleet(config: FleetConfig) -> LocalFleet:
    """Start the four reference servers in this loop, callees first."""
    fleet = LocalFleet()
    try:
        for kind in START_ORDER:
            factory, options = factory_options(kind, config, fleet.urls)
            fleet.servers[kind] = await start_local_server(
                kind, factory, config.server_name(kind), config, **options
            )
    except BaseException:
        await fleet.stop()
        raise
    return fleet
