"""What a hosted Gym server provides, how it is named, and how its app is served.

A `ServerSpec` is the picklable description a `ParticipantHost` actor is built
from (Ray re-runs `__init__` with it on a restart, so it must be all the host
needs).  Its `factory` is an importable ``"module:function"`` called as
``factory(name=..., settings=..., **options)`` and returning a `GymServer`.
A spec with a `url` instead names a server that runs in its own process
(sidecar mode, see `ray_ckpt.hosting.sidecar`).

How an app is served is `ray_ckpt.gym_server.serving`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec
from aiohttp import web

from ray_ckpt.control.asgi import ASGIApp
from ray_ckpt.control.protocol import KINDS, Participant
from ray_ckpt.settings import CheckpointSettings

# Worker processes per host: a bound, not a tuning (each is a full server copy).
MAX_WORKERS = 64
# How a server with workers spreads its requests (`ray_ckpt.workers.routing`):
# any worker takes any request, or the worker that owns the rollout serves it.
SHARED = "shared"
ROLLOUT = "rollout"
SPREADING = (SHARED, ROLLOUT)

if TYPE_CHECKING:
    from ray_ckpt.control.engine import ParticipantEngine


@runtime_checkable
class GymServer(Protocol):
    """One Gym server a `ParticipantHost` runs in its own event loop."""

    kind: str  # environment | model | agent | resources
    participant: Participant  # its hooks

    def app(self) -> web.Application | ASGIApp:
        """The server's data routes (an unfrozen aiohttp app, or any ASGI app)."""
        ...

    def attach(self, engine: ParticipantEngine) -> None:
        """Give the data routes the engine (retire marks, notify); only when enabled."""
        ...

    async def aclose(self) -> None:
        """Release what the server holds, after its routes stopped serving."""
        ...


class NamedControlOps:
    """One Ray actor method per control operation, all through `call(op, body)`.

    The coordinator calls hosts by operation name; hosted and sidecar hosts
    differ only in what `call` does (the local engine, or a forward).
    """

    async def call(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    async def prepare(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.call("prepare", body)

    async def renew(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.call("renew", body)

    async def commit(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.call("commit", body)

    async def restore(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.call("restore", body)

    async def resume(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.call("resume", body)

    async def retire(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.call("retire", body)

    async def forget(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.call("forget", body)

    async def ack(self, body: dict[str, Any]) -> dict[str, Any]:
        """Completion receipts: free acknowledged results (`{"receipts": [...]}`)."""
        return await self.call("ack", body)

    async def collect(self, body: dict[str, Any]) -> dict[str, Any]:
        """Completion receipts: every finished, unacknowledged result held."""
        return await self.call("collect", body)


class ServerSpec(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    name: str
    factory: str = ""  # "module:function"; empty for a sidecar
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 0
    settings: dict[str, Any] = msgspec.field(default_factory=dict)  # the checkpoint block
    url: str | None = None  # sidecar: the base URL of a server running in its own process
    # Worker processes under this one host (`ray_ckpt.workers`): how many,
    # how requests spread over them ("shared" or "rollout"), and whether the
    # server holds no per-episode state (then it never blocks a checkpoint).
    workers: int = 1
    spreading: str = SHARED
    stateless: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown participant kind {self.kind!r}; expected one of {KINDS}")
        if not self.name or "/" in self.name:
            raise ValueError(f"server name {self.name!r} must be non-empty and contain no '/'")
        if (self.url is not None) == bool(self.factory):
            raise ValueError("a spec names exactly one of a factory ('module:function') or a url")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"workers must be in [1, {MAX_WORKERS}], got {self.workers}")
        if self.spreading not in SPREADING:
            raise ValueError(f"spreading must be one of {SPREADING}, got {self.spreading!r}")
        if self.url is not None and self.workers > 1:
            raise ValueError("a sidecar server runs its own processes: workers must be 1")

    def __repr__(self) -> str:
        # The settings hold the control token: never print them.
        where = self.url or f"{self.factory} on {self.host}:{self.port}"
        return f"ServerSpec({self.kind}/{self.name}, {where})"

    @property
    def actor_name(self) -> str:
        return actor_name(self.kind, self.name)

    def checkpoint_settings(self) -> CheckpointSettings:
        return CheckpointSettings.model_validate(self.settings)


def current_node_id() -> str:
    """The Ray node this process runs on (the default placement of a host)."""
    import ray

    return str(ray.get_runtime_context().get_node_id())


def actor_name(kind: str, name: str) -> str:
    return f"{kind}/{name}"


def settings_dict(settings: CheckpointSettings) -> dict[str, Any]:
    """The settings as plain data for a spec, token included (specs travel to actors)."""
    data = settings.model_dump(exclude={"control_auth_token"})
    if settings.control_auth_token is not None:
        data["control_auth_token"] = settings.control_auth_token.get_secret_value()
    return data


def import_factory(ref: str) -> Callable[..., Any]:
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"factory {ref!r} must be 'module:function'")
    target: Any = importlib.import_module(module)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"factory {ref!r} is not callable")
    return target  # type: ignore[no-any-return]


def load_server(spec: ServerSpec) -> GymServer:
    """Build the spec's Gym server (not yet serving)."""
    if spec.url is not None:
        raise ValueError(f"{spec!r} is a sidecar: its server runs in its own process")
    factory = import_factory(spec.factory)
    server = factory(name=spec.name, settings=spec.checkpoint_settings(), **spec.options)
    if not isinstance(server, GymServer):
        raise TypeError(f"{spec.factory} returned {type(server).__name__}, not a GymServer")
    if server.kind != spec.kind or server.participant.kind != spec.kind:
        raise ValueError(f"{spec.factory} built a {server.kind} server; the spec says {spec.kind}")
    return server
