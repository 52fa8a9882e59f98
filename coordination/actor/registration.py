"""Registering participants with the core: Ray actors by name, servers by URL.

Discovery finds every `<kind>/<name>` actor in the coordinator's namespace and
registers it once its status confirms its kind; a member whose name no live
actor holds any more is dropped.  HTTP servers are registered by URL and
token, each with its own control connection pool.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from coordination.engine.coordinator_core import CoordinatorCore
from coordination.engine.host import Host
from coordination.engine.membership import KindMismatch
from coordination.engine.order import Member
from coordination.reach.hosts import HttpHost, RayHost
from ray_ckpt.control.client import ControlClient
from ray_ckpt.control.protocol import KINDS
from ray_ckpt.errors import InvalidRequest

log = logging.getLogger(__name__)


async def register_named(
    core: CoordinatorCore, namespace: str, member: Member, actor_name: str
) -> bool:
    """Register the actor named `actor_name`; False if no such actor lives."""
    import ray

    try:
        handle = await asyncio.to_thread(ray.get_actor, actor_name, namespace=namespace)
    except ValueError:
        return False  # gone; its lease covers it
    host = RayHost(member, handle, actor_name=actor_name, named=True)
    await core.drop_host(await core.register_checked(host))
    return True


async def discover_named(core: CoordinatorCore, namespace: str, *, refresh: bool) -> list[str]:
    """Register the participant actors of `namespace`, drop the vanished ones;
    every key registered after.  A kind mismatch registers the others, then
    raises `KindMismatch` naming it."""
    import ray

    # all_namespaces=True and a filter: inside an actor, the job's namespace
    # need not be the one this coordinator was named in.
    found = await asyncio.to_thread(ray.util.list_named_actors, True)
    live: set[str] = set()
    mismatched: list[str] = []
    for item in found:
        name = item["name"] if isinstance(item, dict) else str(item)
        if isinstance(item, dict) and item.get("namespace") != namespace:
            continue
        kind, sep, rest = name.partition("/")
        if not sep or kind not in KINDS or not rest or "/" in rest:
            continue
        live.add(name)
        if name in core.hosts and not refresh:
            continue
        try:
            await register_named(core, namespace, Member(kind, rest), name)
        except KindMismatch as exc:
            # The others are still registered; the mismatch is raised below.
            mismatched.append(exc.detail)
    for key, host in list(core.hosts.items()):
        if isinstance(host, RayHost) and host.named and host.actor_name not in live:
            log.warning("%s: no live actor named %s; dropped", key, host.actor_name)
            await core.drop_host(core.unregister(key, lost=True))
    if mismatched:
        raise KindMismatch("; ".join(mismatched))
    return sorted(core.hosts)


async def register_actor(
    core: CoordinatorCore, namespace: str, member: Member, handle: Any = None
) -> str:
    """Register an actor by handle, or (None) the live one named `member.key`."""
    if handle is None:
        if not await register_named(core, namespace, member, member.key):
            raise InvalidRequest(f"no actor named {member.key} in namespace {namespace}")
    else:
        await core.drop_host(await core.register_checked(RayHost(member, handle)))
    return member.key


async def register_host(core: CoordinatorCore, host: Host) -> str:
    """Register `host` once its status confirms its kind; closed if refused."""
    try:
        old = await core.register_checked(host)
    except BaseException:
        await host.aclose()
        raise
    await core.drop_host(old)
    return host.member.key


def http_host(
    kind: str, name: str, url: str, token: str, *, limit: int, limit_per_host: int
) -> HttpHost:
    return HttpHost(
        Member(kind, name),
        ControlClient(url, token=token, limit=limit, limit_per_host=limit_per_host),
    )
