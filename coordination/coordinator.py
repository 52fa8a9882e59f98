"""The `Coordinator` Ray actor: a `CoordinatorCore` plus what only Ray needs.

Named, one per namespace, `num_cpus=0`, async, restartable (`max_restarts=-1`)
and optionally detached so it outlives the driver.  Ray restarts an actor by
re-running `__init__`, so `__init__` schedules recovery: the journal names the
checkpoint the previous incarnation left open and who took part, and it is
aborted (resumed everywhere) before any new call is served.  Participants are
registered (actor handle or URL + token) or discovered by name:
`<kind>/<name>` actors in the coordinator's namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from typing import Any

from coordination.core import CoordinatorCore
from coordination.hosts import Host, HttpHost, RayHost, RayPauseTarget
from coordination.journal import Journal
from coordination.membership import KindMismatch
from coordination.order import Member
from coordination.results import (
    CheckpointResult,
    CommitResult,
    CoordinatorStatus,
    ForgetResult,
    PrepareResult,
    RestoreResult,
    ResumeResult,
    RetireResult,
    Timeouts,
)
from ray_ckpt.control.client import ControlClient
from ray_ckpt.control.protocol import KINDS
from ray_ckpt.errors import InvalidRequest
from ray_ckpt.identity import EpisodeId

log = logging.getLogger(__name__)

COORDINATOR_NAME = "ray-ckpt-coordinator"
MAX_CONCURRENCY = 1000


def default_state_dir(namespace: str, name: str = COORDINATOR_NAME) -> str:
    return os.path.join(tempfile.gettempdir(), "ray-ckpt", namespace, name)


class Coordinator:
    def __init__(
        self,
        namespace: str,
        *,
        state_dir: str | None = None,
        timeouts: dict[str, float] | None = None,
        pause_mode: str = "full",
        auto_discover: bool = True,
    ) -> None:
        if not namespace:
            raise InvalidRequest("the coordinator needs an explicit Ray namespace")
        self.namespace = namespace
        self.auto_discover = auto_discover
        self.core = CoordinatorCore(
            journal=Journal(state_dir or default_state_dir(namespace)),
            timeouts=Timeouts(**timeouts) if timeouts else None,
            pause_mode=pause_mode,
        )
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
        entry = self.core.journal.load()
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
        return await self.core.recover()

    # --- membership ----------------------------------------------------------
    async def _register_named(self, member: Member, actor_name: str) -> bool:
        import ray

        try:
            handle = await asyncio.to_thread(ray.get_actor, actor_name, namespace=self.namespace)
        except ValueError:
            return False  # gone; its lease covers it
        host = RayHost(member, handle, actor_name=actor_name, named=True)
        await self.core.drop_host(await self.core.register_checked(host))
        return True

    async def discover(self, *, refresh: bool = False) -> list[str]:
        """Register every `<kind>/<name>` actor of this namespace and drop the
        members found by a name no live actor has any more; returns all keys.

        Membership only: an open checkpoint keeps the members it was
        prepared with (`PhaseDriver.frozen`), a newcomer joins the next one."""
        import ray

        # all_namespaces=True and a filter: inside an actor, the job's namespace
        # need not be the one this coordinator was named in.
        found = await asyncio.to_thread(ray.util.list_named_actors, True)
        live: set[str] = set()
        mismatched: list[str] = []
        for item in found:
            name = item["name"] if isinstance(item, dict) else str(item)
            if isinstance(item, dict) and item.get("namespace") != self.namespace:
                continue
            kind, sep, rest = name.partition("/")
            if not sep or kind not in KINDS or not rest or "/" in rest:
                continue
            live.add(name)
            if name in self.core.hosts and not refresh:
                continue
            try:
                await self._register_named(Member(kind, rest), name)
            except KindMismatch as exc:
                # The others are still registered; the mismatch is raised below.
                mismatched.append(exc.detail)
        for key, host in list(self.core.hosts.items()):
            if isinstance(host, RayHost) and host.named and host.actor_name not in live:
                log.warning("%s: no live actor named %s; dropped", key, host.actor_name)
                await self.core.drop_host(self.core.unregister(key))
        if mismatched:
            raise KindMismatch("; ".join(mismatched))
        return sorted(self.core.hosts)

    async def register_actor(self, kind: str, name: str, handle: Any = None) -> str:
        member = Member(kind, name)
        if handle is None:
            if not await self._register_named(member, member.key):
                raise InvalidRequest(f"no actor named {member.key} in namespace {self.namespace}")
        else:
            await self.core.drop_host(await self.core.register_checked(RayHost(member, handle)))
        return member.key

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
        member = Member(kind, name)
        host = HttpHost(
            member, ControlClient(url, token=token, limit=limit, limit_per_host=limit_per_host)
        )
        try:
            old = await self.core.register_checked(host)
        except BaseException:
            await host.aclose()
            raise
        await self.core.drop_host(old)
        return member.key

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
            HttpHost(
                Member(kind, name),
                ControlClient(url, token=token, limit=limit, limit_per_host=limit_per_host),
            )
            for kind, name, url in servers
        ]
        registered, skipped = await self.core.discover_http(hosts)
        return {"registered": registered, "skipped": skipped}

    async def unregister(self, key: str) -> None:
        await self.core.drop_host(self.core.unregister(key))

    async def register_pause(
        self,
        role: str,
        handle: Any,
        *,
        pause_method: str = "pause",
        resume_method: str = "resume",
        pass_args: bool = True,
        mode: str | None = None,
    ) -> None:
        target = RayPauseTarget(
            role,
            handle,
            pause_method=pause_method,
            resume_method=resume_method,
            pass_args=pass_args,
        )
        self.core.register_pause(target, mode=mode)

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
        return await self.core.commit(
            checkpoint_dir, scope, stop=stop, strict=strict, deadline_s=deadline_s
        )

    async def resume(self, deadline_s: float | None = None) -> ResumeResult:
        await self._ready()
        return await self.core.resume(deadline_s)

    async def renew(self) -> dict[str, float | None]:
        await self._ready()
        return await self.core.renew()

    async def checkpoint(
        self,
        checkpoint_dir: str,
        scope: list[EpisodeId] | None = None,
        resume: bool = True,
        stop: bool = False,
        prepare_s: float | None = None,
        commit_s: float | None = None,
        strict: bool = False,
    ) -> CheckpointResult:
        await self._ready(discover=True)
        return await self.core.checkpoint(
            checkpoint_dir,
            scope,
            resume=resume,
            stop=stop,
            strict=strict,
            prepare_s=prepare_s,
            commit_s=commit_s,
        )

    async def restore(
        self,
        checkpoint_dir: str,
        episode_ids: list[EpisodeId],
        resume: bool = True,
        deadline_s: float | None = None,
        allow_without_gym_manifest: bool = False,
    ) -> RestoreResult:
        # A restore runs on a fresh fleet: re-resolve every name to its new actor.
        await self._ready(discover=True, refresh=True)
        return await self.core.restore(
            checkpoint_dir,
            episode_ids,
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

    async def status(self) -> CoordinatorStatus:
        await self._ready(discover=True)
        return await self.core.status()


def coordinator_options(
    namespace: str, *, name: str = COORDINATOR_NAME, detached: bool = False
) -> dict[str, Any]:
    if not namespace:
        raise InvalidRequest("the coordinator needs an explicit Ray namespace")
    opts: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "get_if_exists": True,
        "num_cpus": 0,
        "max_restarts": -1,
        # A call in flight when the coordinator dies fails to its caller; the
        # restarted coordinator aborts the checkpoint, the caller starts anew.
        "max_task_retries": 0,
        "max_concurrency": MAX_CONCURRENCY,
    }
    if detached:
        opts["lifetime"] = "detached"
    return opts


def get_or_create_coordinator(
    namespace: str,
    *,
    name: str = COORDINATOR_NAME,
    detached: bool = False,
    state_dir: str | None = None,
    timeouts: dict[str, float] | None = None,
    pause_mode: str = "full",
    auto_discover: bool = True,
) -> Any:
    """The named coordinator of `namespace` (created if missing); an actor handle."""
    import ray

    actor_cls = ray.remote(Coordinator)
    return actor_cls.options(**coordinator_options(namespace, name=name, detached=detached)).remote(
        namespace,
        state_dir=state_dir or default_state_dir(namespace, name),
        timeouts=timeouts,
        pause_mode=pause_mode,
        auto_discover=auto_discover,
    )
