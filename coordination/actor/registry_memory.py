"""What was registered by hand, kept so a restarted coordinator needs no second call.

Ray-actor participants are found again by name (`discover`), but an
HTTP-only participant (its URL and control token) and the pause targets (the
trainer's and the assembler's actor handles, their method names and the
assembler's scope method) exist only because someone registered them.  The
coordinator keeps them here after each registration; Ray restarts a
coordinator by re-running `__init__` (on any node, if its node is lost), and
recovery registers them again before it aborts the checkpoint left open, so
an HTTP member of that checkpoint is resumed too.

They live in Ray's GCS key-value store, never in `state_dir`: they hold a
control token and serialized actor handles, which belong inside the cluster,
not in a file a user may share.  Only the same actor, restarted, takes them
back (`actor_id`, as for the periodic loop): a new coordinator created under
the name starts empty.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from coordination.actor.gcs import kv_del, kv_get, kv_put
from coordination.actor.registration import http_host, register_host
from coordination.reach.hosts import RayPauseTarget
from coordination.triggers.periodic import AssemblerScope

if TYPE_CHECKING:
    from coordination.engine.coordinator_core import CoordinatorCore

log = logging.getLogger(__name__)


class HttpRegistration(msgspec.Struct, frozen=True):
    kind: str
    name: str
    url: str
    token: str
    limit: int
    limit_per_host: int


class PauseRegistration(msgspec.Struct, frozen=True):
    role: str
    handle: bytes  # the actor handle, serialized with Ray's cloudpickle
    pause_method: str
    resume_method: str
    pass_args: bool
    mode: str | None
    scope_method: str | None


class Registrations(msgspec.Struct):
    actor_id: str
    http: dict[str, HttpRegistration] = msgspec.field(default_factory=dict)  # by member key
    pauses: dict[str, PauseRegistration] = msgspec.field(default_factory=dict)  # by role


def dump_handle(handle: object) -> bytes:
    import ray.cloudpickle

    dumps: Callable[[object], bytes] = ray.cloudpickle.dumps
    return bytes(dumps(handle))


def load_handle(data: bytes) -> object:
    import ray.cloudpickle

    return ray.cloudpickle.loads(data)


class RegistryMemory:
    """One key in the GCS KV store; nothing at all off Ray (the pure core's tests)."""

    def __init__(self, *, namespace: str, name: str, actor_id: str) -> None:
        self.key = f"registry/{namespace}/{name}".encode()
        self.actor_id = actor_id

    def _enabled(self) -> bool:
        import ray

        return bool(self.actor_id) and ray.is_initialized()

    def save(self, registrations: Registrations) -> None:
        if not self._enabled():
            return
        kv_put(self.key, msgspec.json.encode(registrations))

    def load(self) -> Registrations:
        """This actor's registrations from before a restart (another actor's: none)."""
        empty = Registrations(actor_id=self.actor_id)
        if not self._enabled():
            return empty
        data = kv_get(self.key)
        if data is None:
            return empty
        try:
            found = msgspec.json.decode(data, type=Registrations)
        except msgspec.DecodeError:
            log.warning("unreadable registrations ignored")
            return empty
        if found.actor_id != self.actor_id:
            log.warning("forgot the registrations of another coordinator under this name")
            kv_del(self.key)
            return empty
        return found


class RegistryKeeper:
    """The coordinator's registrations in memory and in the KV store."""

    def __init__(self, memory: RegistryMemory) -> None:
        self.memory = memory
        self.current = Registrations(actor_id=memory.actor_id)

    async def _save(self) -> None:
        try:
            await asyncio.to_thread(self.memory.save, self.current)
        except Exception:
            log.exception("registered, but a restarted coordinator will not know it")

    async def http(self, reg: HttpRegistration) -> None:
        self.current.http[f"{reg.kind}/{reg.name}"] = reg
        await self._save()

    async def pause(self, reg: PauseRegistration) -> None:
        self.current.pauses[reg.role] = reg
        await self._save()

    async def drop(self, key: str) -> None:
        if self.current.http.pop(key, None) is not None:
            await self._save()

    async def register_again(self, core: CoordinatorCore) -> dict[str, AssemblerScope | None]:
        """Register again what this actor registered before Ray restarted it;
        the pause targets' scopes by role.  One that fails is logged (the next
        call that needs it says more) and the others still come back."""
        try:
            self.current = await asyncio.to_thread(self.memory.load)
        except Exception:
            log.exception("could not read the registrations kept before a restart")
        for key, h in list(self.current.http.items()):
            try:
                await register_http(core, h)
            except Exception as exc:
                log.warning("could not register %s again after a restart: %r", key, exc)
        scopes: dict[str, AssemblerScope | None] = {}
        for role, p in list(self.current.pauses.items()):
            try:
                scopes[role] = register_pause(core, p, load_handle(p.handle))
            except Exception as exc:
                log.warning("could not register the %s again after a restart: %r", role, exc)
        return scopes


async def register_http(core: CoordinatorCore, reg: HttpRegistration) -> str:
    host = http_host(
        reg.kind, reg.name, reg.url, reg.token, limit=reg.limit, limit_per_host=reg.limit_per_host
    )
    return await register_host(core, host)


def register_pause(
    core: CoordinatorCore, reg: PauseRegistration, handle: Any
) -> AssemblerScope | None:
    """Register the pause target; the assembler's scope source (None if it names
    no scope method, or for the trainer)."""
    target = RayPauseTarget(
        reg.role,
        handle,
        pause_method=reg.pause_method,
        resume_method=reg.resume_method,
        pass_args=reg.pass_args,
    )
    core.register_pause(target, mode=reg.mode)
    if reg.role == "assembler" and reg.scope_method:
        return AssemblerScope(handle, reg.scope_method, core.timeouts.pause_s)
    return None
