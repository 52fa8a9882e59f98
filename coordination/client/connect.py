"""Attach to Ray and get the namespace's coordinator: `connect`.

Kept apart from the handle class so attaching (Ray init, get-or-create, the
retry around a dying coordinator) reads on its own; `from coordination import
connect` is its usual import.  It imports the handle (what it returns) and,
to create the actor, the actor class; neither imports this module.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from typing import Any

from coordination.actor.actor_options import COORDINATOR_NAME, coordinator_options
from coordination.client.handle import CoordinatorHandle
from ray_ckpt.errors import ParticipantUnavailable


def connect(
    namespace: str = "ray-ckpt",
    address: str | None = "auto",
    *,
    create: bool = True,
    name: str = COORDINATOR_NAME,
    **coordinator_options: Any,
) -> CoordinatorHandle:
    """Attach to Ray (only if not yet initialised) and get the named coordinator.

    `address`: "auto" attaches to a running cluster, None starts a local one,
    anything else is a cluster address.  `create=False` only finds one.
    """
    import ray

    if not namespace:
        raise ValueError("connect needs an explicit namespace")
    if not ray.is_initialized():
        ray.init(
            address=address, namespace=namespace, ignore_reinit_error=True, log_to_driver=False
        )
    if create:
        actor = _live_coordinator(namespace, name, coordinator_options)
        _say_if_other_options(actor, namespace, name, coordinator_options)
    else:
        try:
            actor = ray.get_actor(name, namespace=namespace)
        except ValueError:
            raise ParticipantUnavailable(
                f"no coordinator {name!r} in namespace {namespace!r}"
            ) from None
    return CoordinatorHandle(actor, namespace)


async def aconnect(
    namespace: str = "ray-ckpt",
    address: str | None = "auto",
    *,
    create: bool = True,
    name: str = COORDINATOR_NAME,
    **coordinator_options: Any,
) -> CoordinatorHandle:
    """`connect` for async code: the waits (get-or-create, the first ping) run
    on a thread, so the caller's event loop keeps running."""
    import ray

    if not namespace:
        raise ValueError("connect needs an explicit namespace")
    if not ray.is_initialized():
        # Here, not on the thread: Ray's init expects the main thread.
        ray.init(
            address=address, namespace=namespace, ignore_reinit_error=True, log_to_driver=False
        )
    return await asyncio.to_thread(
        connect, namespace, address, create=create, name=name, **coordinator_options
    )


def _live_coordinator(namespace: str, name: str, options: dict[str, Any]) -> Any:
    """Get or create the coordinator and make sure it answers.

    A coordinator that is not detached dies with the driver that created it
    (e.g. an earlier `ray-ckpt` command); for a moment after, `get_if_exists`
    can still hand out the dying actor.  Retry until a live one answers.
    """
    import ray
    from ray.exceptions import RayActorError

    for _ in range(_CONNECT_TRIES - 1):
        actor = get_or_create_coordinator(namespace, name=name, **options)
        try:
            ray.get(actor.ping.remote(), timeout=60)
            return actor
        except RayActorError:
            time.sleep(0.25)
    return get_or_create_coordinator(namespace, name=name, **options)


_CONNECT_TRIES = 40


def _say_if_other_options(
    actor: Any, namespace: str, name: str, asked: dict[str, Any]
) -> list[str]:
    """Warn when the coordinator found (not created) runs with other options
    than the ones asked for: they were not applied, and silently ignoring them
    would leave e.g. a CLI believing its coordinator outlives it."""
    import ray

    if not asked:
        return []
    have: dict[str, Any] = ray.get(actor.creation_options.remote(), timeout=60)
    differ = [
        f"{k}={have.get(k)!r} (asked {_normal(k, v)!r})"
        for k, v in sorted(asked.items())
        if k in have and _normal(k, v) != have[k]
    ]
    if differ:
        warnings.warn(
            f"coordinator {name!r} in namespace {namespace!r} already exists with "
            f"{', '.join(differ)}; the options asked for were not applied "
            "(stop it first to start one with them)",
            stacklevel=3,
        )
    return differ


def _normal(key: str, value: Any) -> Any:
    return dict(value or {}) if key == "timeouts" else value


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

    from coordination.actor.coordinator import Coordinator

    actor_cls = ray.remote(Coordinator)
    return actor_cls.options(**coordinator_options(namespace, name=name, detached=detached)).remote(
        namespace,
        # None: the journal lives in Ray's GCS KV store, reachable from every
        # node, so a restart on another node finds it (coordination/engine/journal.py).
        state_dir=state_dir,
        timeouts=timeouts,
        pause_mode=pause_mode,
        auto_discover=auto_discover,
        detached=detached,
    )
