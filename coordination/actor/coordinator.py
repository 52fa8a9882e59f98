"""The `Coordinator` Ray actor: a `CoordinatorCore` plus what only Ray needs.

Named, one per namespace, `num_cpus=0`, async, restartable (`max_restarts=-1`)
and optionally detached so it outlives the driver.  Ray restarts an actor by
re-running `__init__`, so `__init__` schedules recovery: the journal names the
checkpoint the previous incarnation left open and who took part, and it is
aborted (resumed everywhere) before any new call is served.  Participants are
registered (actor handle or URL + token) or discovered by name:
`<kind>/<name>` actors in the coordinator's namespace
(`coordination.actor.registration`).

Every location a call names is checked before anyone is paused
(`coordination.engine.roots`); the periodic checkpoint loop runs here too
(`coordination.actor.periodic_control`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec

from coordination.actor.actor_options import COORDINATOR_NAME
from coordination.actor.drain_control import DrainControl, DrainStatus, Relauncher
from coordination.actor.gcs import GcsEpochs, open_journal
from coordination.actor.periodic_control import PeriodicControl, PeriodicMemory
from coordination.actor.ray_metrics import ray_sink
from coordination.actor.registration import (
    discover_named,
    http_host,
    register_actor,
    register_named,
)
from coordination.actor.registry_memory import (
    HttpRegistration,
    PauseRegistration,
    RegistryKeeper,
    RegistryMemory,
    dump_handle,
    register_http,
    register_pause,
)
from coordination.engine import receipts
from coordination.engine.baseline import Trigger
from coordination.engine.coordinator_core import CoordinatorCore
from coordination.engine.host import Host
from coordination.engine.membership import KindMismatch
from coordination.engine.metrics import CoordinatorMetrics
from coordination.engine.options import CheckpointOptions
from coordination.engine.order import Member
from coordination.engine.receipts import AckResult, CollectResult
from coordination.engine.results import (
    CheckpointResult,
    CommitResult,
    CoordinatorStatus,
    DurableResult,
    ForgetResult,
    PeriodicStatus,
    PrepareResult,
    RestoreResult,
    ResumeResult,
    RetireResult,
    Timeouts,
)
from coordination.engine.roots import restore_target, writable
from coordination.engine.timeline import StorageHistory, chrome_trace
from coordination.triggers.periodic import DEFAULT_PREFIX, AssemblerScope
from ray_ckpt.errors import InvalidRequest
from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import Receipt

log = logging.getLogger(__name__)


def _own_name() -> str:
    """This actor's name (the journal's key), or the default one off Ray."""
    import ray

    name = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
    return name or COORDINATOR_NAME


def _on_ray() -> bool:
    import ray

    return bool(ray.is_initialized())


def _own_id() -> str:
    """This actor's ID, the same across its restarts ("" off Ray)."""
    import ray

    return (ray.get_runtime_context().get_actor_id() or "") if ray.is_initialized() else ""


class Coordinator:
    def __init__(
        self,
        namespace: str,
        *,
        state_dir: str | None = None,
        timeouts: dict[str, float] | None = None,
        pause_mode: str = "full",
        auto_discover: bool = True,
        detached: bool = False,
    ) -> None:
        if not namespace:
            raise InvalidRequest("the coordinator needs an explicit Ray namespace")
        self.namespace = namespace
        # What it was created with: `connect` says so when asked for others.
        self.created_with: dict[str, Any] = {
            "detached": detached,
            "state_dir": state_dir,
            "timeouts": dict(timeouts or {}),
            "pause_mode": pause_mode,
            "auto_discover": auto_discover,
        }
        self.auto_discover = auto_discover
        self.core = CoordinatorCore(
            journal=open_journal(state_dir, namespace=namespace, name=_own_name()),
            timeouts=Timeouts(**timeouts) if timeouts else None,
            pause_mode=pause_mode,
            metrics=CoordinatorMetrics(ray_sink()),
            # Each checkpoint's timeline saved with it, each restore's beside it.
            history=StorageHistory(),
        )
        # The registered assembler's in-flight episodes (if it names a method):
        # the scope of every checkpoint taken without one.
        self.scope_source: AssemblerScope | None = None
        memory = PeriodicMemory(state_dir, namespace=namespace, name=_own_name())
        self.periodic = PeriodicControl(
            self._periodic_checkpoint, self.core.clock, memory, actor_id=_own_id()
        )
        # HTTP participants and pause targets, kept across a restart.
        self.registry = RegistryKeeper(
            RegistryMemory(namespace=namespace, name=_own_name(), actor_id=_own_id())
        )
        self.drains = DrainControl(self)
        self._recovery: asyncio.Task[str | None] | None = None
        with contextlib.suppress(RuntimeError):  # no loop here: recover on the first call
            self._recovery = asyncio.get_running_loop().create_task(self._recover())

    async def _ready(self, *, discover: bool = False, refresh: bool = False) -> None:
        if self._recovery is None:
            self._recovery = asyncio.ensure_future(self._recover())
        await asyncio.shield(self._recovery)
        if discover and self.auto_discover:
            await self.discover(refresh=refresh)

    async def _recover(self) -> str | None:
        # First of all, before any call to a participant: this incarnation's
        # epoch, newer than any previous one's, which may still run cut off
        # (`coordination.engine.epoch`).  Every call after carries it, so
        # recovery's own resume already fences the old one off.
        if _on_ray():
            self.core.epoch = await asyncio.to_thread(GcsEpochs(self.namespace, _own_name()).epoch)
            log.info("coordinator %s takes epoch %d", _own_name(), self.core.epoch.value)
        for role, scope in (await self.registry.register_again(self.core)).items():
            if role == "assembler":
                self.scope_source = scope
        await self.core.settle_journal()
        entry = await asyncio.to_thread(self.core.journal.load)
        if entry is not None:
            for key, how in entry.members.items():
                if how.get("transport") == "ray":
                    await self._register_named(Member.parse(key), how.get("actor", key))
        if self.auto_discover:
            try:
                await self.discover(refresh=True)
            except KindMismatch as exc:
                # Recovery must still abort what was left open; the mismatch
                # fails the next discovery (every prepare) by name.
                log.error("discovery during recovery: %s", exc)
        aborted = await self.core.recover()
        await self.periodic.restart()
        return aborted

    # --- membership (coordination.actor.registration) ------------------------------
    async def _register_named(self, member: Member, actor_name: str) -> bool:
        return await register_named(self.core, self.namespace, member, actor_name)

    async def discover(self, *, refresh: bool = False) -> list[str]:
        """Register every `<kind>/<name>` actor of this namespace and drop the
        members found by a name no live actor has any more; returns all keys.

        Membership only: an open checkpoint keeps the members it was
        prepared with (`PhaseDriver.frozen`), a newcomer joins the next one."""
        return await discover_named(self.core, self.namespace, refresh=refresh)

    async def register_actor(self, kind: str, name: str, handle: Any = None) -> str:
        return await register_actor(self.core, self.namespace, Member(kind, name), handle)

    async def register_http(
        self,
        kind: str,
        name: str,
        url: str,
        token: str,
        *,
        limit: int = 64,
        limit_per_host: int = 8,
    ) -> str:
        reg = HttpRegistration(kind, name, url, token, limit, limit_per_host)
        key = await register_http(self.core, reg)
        await self.registry.http(reg)
        return key

    async def discover_http(
        self,
        servers: list[tuple[str, str, str]],
        token: str,
        *,
        limit: int = 64,
        limit_per_host: int = 8,
    ) -> dict[str, list[str]]:
        """Register the HTTP servers `(kind, name, url)` that are participants.

        A server answering 404 on status is not one (skipped, as NeMo Gym's
        discovery does); any other failure or a kind mismatch fails the whole
        discovery (`CoordinationFailed`) and registers none."""
        hosts: list[Host] = [
            http_host(kind, name, url, token, limit=limit, limit_per_host=limit_per_host)
            for kind, name, url in servers
        ]
        registered, skipped = await self.core.discover_http(hosts)
        for kind, name, url in servers:
            if f"{kind}/{name}" in registered:
                await self.registry.http(
                    HttpRegistration(kind, name, url, token, limit, limit_per_host)
                )
        return {"registered": registered, "skipped": skipped}

    async def unregister(self, key: str) -> None:
        await self.core.drop_host(self.core.unregister(key))
        await self.registry.drop(key)

    async def register_pause(
        self,
        role: str,
        handle: Any,
        *,
        pause_method: str = "pause",
        resume_method: str = "resume",
        pass_args: bool = True,
        mode: str | None = None,
        scope_method: str | None = None,
    ) -> None:
        """`scope_method` (assembler only): the method returning the episodes
        in flight, asked for the scope of a checkpoint that names none."""
        if scope_method is not None and role != "assembler":
            raise InvalidRequest("only the assembler names a scope method")
        reg = PauseRegistration(
            role, dump_handle(handle), pause_method, resume_method, pass_args, mode, scope_method
        )
        scope = register_pause(self.core, reg, handle)
        if role == "assembler":
            self.scope_source = scope
        await self.registry.pause(reg)

    async def creation_options(self) -> dict[str, Any]:
        return dict(self.created_with)

    async def members(self) -> list[str]:
        await self._ready()
        return sorted(self.core.hosts)

    async def ping(self) -> str | None:
        """Waits for recovery; returns the checkpoint ID recovery aborted, if any."""
        await self._ready()
        assert self._recovery is not None
        return self._recovery.result()

    # --- operations ------------------------------------------------------------
    async def prepare(self, deadline_s: float | None = None) -> PrepareResult:
        await self._ready(discover=True)
        return await self.core.prepare(deadline_s)

    async def commit(
        self,
        checkpoint_dir: str,
        scope: list[EpisodeId] | None = None,
        stop: bool = False,
        deadline_s: float | None = None,
        strict: bool = False,
    ) -> CommitResult:
        await self._ready()
        if self.core.open is not None:  # else it is refused without touching storage
            await writable(checkpoint_dir)
        return await self.core.commit(
            checkpoint_dir,
            scope,
            stop=stop,
            strict=strict,
            deadline_s=deadline_s,
            scope_source=self.scope_source,
        )

    async def resume(self, deadline_s: float | None = None) -> ResumeResult:
        await self._ready()
        return await self.core.resume(deadline_s)

    async def renew(self) -> dict[str, float | None]:
        await self._ready()
        return await self.core.renew()

    async def checkpoint(
        self, options: CheckpointOptions | str, scope: list[EpisodeId] | None = None, **fields: Any
    ) -> CheckpointResult:
        """`options`: the checkpoint's, or only its directory with the others
        as keywords (the engine checks them, and refuses both at once)."""
        await self._ready(discover=True)
        # Before anyone is paused: a location that cannot be written is refused
        # (unless a checkpoint is open: that refusal needs no storage).
        if self.core.open is None:
            where = options.checkpoint_dir if isinstance(options, CheckpointOptions) else options
            await writable(where)
        return await self.core.checkpoint(options, scope, scope_source=self.scope_source, **fields)

    async def durable(self, checkpoint_id: str) -> DurableResult:
        """An asynchronous checkpoint once its Gym manifest is written."""
        return await self.core.durable(checkpoint_id)

    async def restore(
        self,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId] | None = None,
        resume: bool = True,
        deadline_s: float | None = None,
        allow_without_gym_manifest: bool = False,
        latest: bool = False,
    ) -> RestoreResult:
        """`latest`: `checkpoint_dir` is a root; restore the checkpoint
        `latest` picks there.  No episodes: every one the checkpoint lists."""
        # An asynchronous checkpoint still publishing is `latest` once it has:
        # `latest` is resolved after it, not before.
        await self.core.pending.settle()
        where, episodes = await restore_target(checkpoint_dir, episode_ids, latest=latest)
        # A restore runs on a fresh fleet: re-resolve every name to its new actor.
        await self._ready(discover=True, refresh=True)
        return await self.core.restore(
            where,
            episodes,
            resume=resume,
            deadline_s=deadline_s,
            allow_without_gym_manifest=allow_without_gym_manifest,
        )

    async def retire(
        self, episode_ids: list[EpisodeId], deadline_s: float | None = None
    ) -> RetireResult:
        await self._ready(discover=True)
        return await self.core.retire(episode_ids, deadline_s=deadline_s)

    async def forget(self, rollout_ids: list[str], deadline_s: float | None = None) -> ForgetResult:
        await self._ready(discover=True)
        return await self.core.forget(rollout_ids, deadline_s=deadline_s)

    # --- completion receipts (coordination.engine.receipts): no lock, no phase -------
    async def collect(self, deadline_s: float | None = None) -> CollectResult:
        """Every finished, unacknowledged result of every environment participant."""
        await self._ready(discover=True)
        return await receipts.collect(self.core, deadline_s)

    async def ack(self, items: list[Receipt], deadline_s: float | None = None) -> AckResult:
        """Free these results everywhere; all or nothing (`UnknownReceipt`)."""
        await self._ready(discover=True)
        return await receipts.ack(self.core, items, deadline_s)

    async def status(self) -> CoordinatorStatus:
        await self._ready(discover=True)
        st = await self.core.status()
        return msgspec.structs.replace(
            st, periodic=self.periodic.status(), scope_source=self.scope_source is not None
        )

    async def timeline(self, which: str = "latest") -> dict[str, Any]:
        """A recent checkpoint (or restore) as a Chrome trace (`coordination.engine.timeline`)."""
        return chrome_trace(self.core.timeline.get(which))

    # --- periodic checkpoints (coordination.actor.periodic_control) -----------------
    async def start_periodic(
        self,
        root: str,
        every_s: float,
        keep_latest_k: int | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> PeriodicStatus:
        await self._ready()
        return await self.periodic.start(
            root, every_s=every_s, keep_latest_k=keep_latest_k, prefix=prefix
        )

    async def stop_periodic(self) -> PeriodicStatus | None:
        return await self.periodic.stop()

    async def _periodic_checkpoint(self, root: str, where: str) -> CheckpointResult:
        await writable(root)  # the root: probing `where` would leave a folder if prepare fails
        await self._ready(discover=True)
        return await self.core.checkpoint(
            CheckpointOptions(checkpoint_dir=where, trigger=Trigger.PERIODIC.value),
            scope_source=self.scope_source,
        )

    # --- Ray node drains (coordination.actor.drain_control) ---------------------------
    async def start_drain_watch(
        self,
        root: str,
        relaunch: Relauncher,
        poll_s: float = 1.0,
        min_budget_s: float | None = None,
        margin_s: float | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> DrainStatus:
        """Watch Ray's draining nodes; a drain of a node holding Gym hosts
        checkpoints under `root` with `stop` inside its deadline, `relaunch`es
        the hosts elsewhere and restores the whole Gym (`DrainStatus.outcomes`)."""
        await self._ready()
        await writable(root)
        opts: dict[str, Any] = {}
        if min_budget_s is not None:
            opts["min_budget_s"] = min_budget_s
        if margin_s is not None:
            opts["margin_s"] = margin_s
        return self.drains.start(root, relaunch, poll_s=poll_s, prefix=prefix, **opts)

    async def stop_drain_watch(self) -> DrainStatus:
        return await self.drains.stop()

    async def drain_status(self) -> DrainStatus:
        return self.drains.status()
