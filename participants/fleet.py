"""Launch the four reference servers as `ParticipantHost` actors, on chosen nodes.

```python
config = FleetConfig(namespace="demo", token="secret", step_delay_s=0.05)
fleet = await launch_fleet(config)        # environment, model, agent, resources
fleet.urls["environment"]                 # POST /run here (participants.rollout)
fleet.hosts["model"].prepare.remote({...})   # control, in KIND_ORDER
fleet.kill()                              # a crash: ray.kill every host
fleet = await launch_fleet(config)        # fresh hosts, same names; restore them
await fleet.stop()                        # graceful
```

Hosts are named `<kind>/<name>` with `name = ref-<kind>[-<suffix>]`, so a
relaunch with the same suffix is found by the same names.  Callees start
first and their URLs are wired into their callers through factory options.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import msgspec
from pydantic import SecretStr

from ray_ckpt.gym_server.spec import ServerSpec, actor_name, settings_dict
from ray_ckpt.hosting.host import start_host, stop_host
from ray_ckpt.settings import CheckpointSettings

# Prepare order (callers first); resume runs it in reverse.
KIND_ORDER = ("environment", "model", "agent", "resources")
# Start order: every server's callees are up before it.
START_ORDER = ("model", "resources", "agent", "environment")
FACTORIES = {
    "environment": "participants.servers.environment:environment_server",
    "model": "participants.servers.model:model_server",
    "agent": "participants.servers.agent:agent_server",
    "resources": "participants.servers.resources:resources_server",
}


class FleetConfig(msgspec.Struct, frozen=True, kw_only=True):
    namespace: str = ""
    token: str = "ray-ckpt-reference-token"
    checkpoint: bool = True  # the `checkpoint.enabled` flag of every server
    lease_grace_seconds: float = 600.0
    step_delay_s: float = 0.0  # each tool call
    verify_delay_s: float | None = None  # each verify (default: step_delay_s)
    token_delay_s: float = 0.0  # each generated token
    tokens_per_turn: int = 8
    turns_per_step: int = 2  # tool rounds per episode step
    verify_mode: str = "wait"  # declared on the seed reply: wait | replay
    resources_mode: str = "exported"  # exported | stateless | restart_only
    model_seed: int = 0
    suffix: str = ""
    # `checkpoint.completion_receipts`: the environment holds each finished
    # result until the driver acknowledges it (`handle.ack`).
    completion_receipts: bool = False
    # Worker processes per server (`ray_ckpt.workers`); with more than one,
    # every reference server spreads by rollout (each holds per-episode state).
    workers: int = 1

    def server_name(self, kind: str) -> str:
        return f"ref-{kind.replace('_', '-')}" + (f"-{self.suffix}" if self.suffix else "")

    def settings(self) -> CheckpointSettings:
        if not self.checkpoint:
            return CheckpointSettings()
        return CheckpointSettings(
            enabled=True,
            control_auth_token=SecretStr(self.token),
            lease_grace_seconds=self.lease_grace_seconds,
            completion_receipts=self.completion_receipts,
        )


def factory_options(
    kind: str, config: FleetConfig, urls: dict[str, str]
) -> tuple[str, dict[str, Any]]:
    """The factory and its options for `kind`, given the URLs started so far."""
    options: dict[str, Any]
    if kind == "model":
        options = {
            "seed": config.model_seed,
            "tokens_per_turn": config.tokens_per_turn,
            "token_delay_s": config.token_delay_s,
        }
    elif kind == "resources":
        options = {
            "mode": config.resources_mode,
            "verify_mode": config.verify_mode,
            "step_delay_s": config.step_delay_s,
            "verify_delay_s": config.verify_delay_s,
        }
    elif kind == "agent":
        options = {
            "model_url": urls["model"],
            "resources_url": urls["resources"],
            "turns_per_step": config.turns_per_step,
            "tokens_per_turn": config.tokens_per_turn,
        }
    elif kind == "environment":
        options = {"agent_url": urls["agent"], "resources_url": urls["resources"]}
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return FACTORIES[kind], options


class Fleet:
    """Handles and URLs of one launched fleet."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.hosts: dict[str, Any] = {}
        self.urls: dict[str, str] = {}
        self.info: dict[str, dict[str, Any]] = {}

    @property
    def placement(self) -> dict[str, str]:
        """The node each host runs on (node ID hex), by kind."""
        return {k: str(info["node_id"]) for k, info in self.info.items()}

    @property
    def names(self) -> dict[str, str]:
        """Actor names, `<kind>/<name>`, by kind."""
        return {k: actor_name(k, self.config.server_name(k)) for k in KIND_ORDER}

    def ordered(self) -> list[tuple[str, Any]]:
        """(kind, handle) in prepare order."""
        return [(k, self.hosts[k]) for k in KIND_ORDER if k in self.hosts]

    def kill(self) -> None:
        """A crash: end every host process now, without draining anything."""
        import ray

        for handle in self.hosts.values():
            ray.kill(handle, no_restart=True)

    async def stop(self, *, timeout_s: float = 30.0) -> None:
        """Graceful stop, callers first, so no server is called after it stopped."""
        for kind in KIND_ORDER:
            if kind in self.hosts:
                await stop_host(self.hosts[kind], timeout_s=timeout_s)


async def launch_fleet(
    config: FleetConfig,
    *,
    start_timeout_s: float = 60.0,
    placement: Mapping[str, str] | None = None,
    listen: Mapping[str, str] | None = None,
) -> Fleet:
    """Start the four hosts and wait until each serves.

    `placement` pins a kind's host to a Ray node (kind -> node ID hex); a kind
    it does not name runs on the caller's node.  Hosts are pinned hard (no
    soft fallback): a host must come back where its callers expect it, and
    a relaunch after a node loss names the surviving node explicitly.
    `listen` names the address a kind's server binds (default 127.0.0.1):
    where nodes are separate hosts, the node's own address, so that callers
    on other nodes (the coordinator, the other servers) reach it.
    """
    if not config.namespace:
        raise ValueError("a fleet needs an explicit Ray namespace")
    placement = dict(placement or {})
    unknown = set(placement) - set(KIND_ORDER)
    if unknown:
        raise ValueError(f"placement names unknown kinds {sorted(unknown)}")
    fleet = Fleet(config)
    settings = settings_dict(config.settings())
    try:
        for kind in START_ORDER:
            factory, options = factory_options(kind, config, fleet.urls)
            spec = ServerSpec(
                kind=kind,
                name=config.server_name(kind),
                factory=factory,
                options=options,
                settings=settings,
                workers=config.workers,
                spreading="rollout",
                host=dict(listen or {}).get(kind, "127.0.0.1"),
            )
            fleet.hosts[kind] = await _start(spec, config.namespace, placement.get(kind))
            info = await asyncio.wait_for(fleet.hosts[kind].ready.remote(), start_timeout_s)
            fleet.info[kind] = info
            fleet.urls[kind] = info["url"]
    except BaseException:
        fleet.kill()
        raise
    return fleet


async def _start(
    spec: ServerSpec, namespace: str, node_id: str | None = None, attempts: int = 50
) -> Any:
    for attempt in range(attempts):
        try:
            return start_host(spec, namespace=namespace, node_id=node_id, get_if_exists=False)
        except ValueError:
            if attempt == attempts - 1:
                raise
            # The name is taken.  A name freed by ray.kill can take a moment to
            # become available again; a host that died by itself (kill -9 of
            # its process) keeps its name while handles to it live, until it
            # is ray.kill'ed.  A live host keeps its name: refuse to replace it.
            await _release_if_dead(spec, namespace)
            await asyncio.sleep(0.1)
    raise AssertionError("unreachable")


async def _release_if_dead(spec: ServerSpec, namespace: str) -> None:
    import ray
    from ray.exceptions import RayActorError

    try:
        old = ray.get_actor(spec.actor_name, namespace=namespace)
    except ValueError:
        return  # already free
    try:
        await asyncio.wait_for(old.ready.remote(), 5.0)
    except RayActorError:
        ray.kill(old, no_restart=True)
        return
    except TimeoutError:
        return  # starting or busy: retry the name later
    raise ValueError(f"{spec.actor_name} is alive in namespace {namespace!r}: not replacing it")
