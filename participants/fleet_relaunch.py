"""Relaunch the reference fleet with the hosts of draining nodes moved away.

The coordinator's drain watch (`coordination.actor.drain_control`) calls a
relauncher after it checkpointed the whole Gym with `stop`: every host comes
back fresh under its name (a restore installs one point in time, so hosts
that were not on the draining node are fresh too), the ones on a draining
node on another node.  `FleetRelauncher` does that for the four reference
servers; it is a plain picklable object, because it travels to the
coordinator actor and runs there.

Every host is relaunched, not only the moved ones, because the reference
servers reach their callees by URL (wired at launch), and a moved host
listens on a new address.  The relaunched hosts share the fate of the process
that ran the relauncher (Ray's ownership): a coordinator that dies takes them
with it, and the driver restores into a fleet it launches itself, as after
any crash.
"""

from __future__ import annotations

import contextlib
from typing import Any

from participants.fleet import KIND_ORDER, Fleet, FleetConfig, launch_fleet
from ray_ckpt.gym_server.spec import actor_name
from ray_ckpt.hosting.host import get_host


def _alive_nodes() -> list[str]:
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return [str(n["NodeID"]) for n in nodes if n.get("Alive")]


def _own_node() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


class FleetRelauncher:
    """`await relauncher(hosts, avoid)`: the fleet again, nothing on `avoid`.

    `hosts`: member keys (`<kind>/<name>`) on the draining nodes; `avoid`:
    those nodes.  A moved host goes to `to` when given, else to the caller's
    node (the coordinator's) unless it is draining too, else to the first
    other live node.  Returns each moved member key → its new node."""

    def __init__(self, config: FleetConfig, *, to: str | None = None) -> None:
        self.config = config
        self.to = to
        # The relaunched hosts are owned by whoever runs this (the
        # coordinator): Ray ends an actor once its owner holds no handle to
        # it, name or not, so the handles are kept here.
        self.fleet: Fleet | None = None

    def _target(self, avoid: list[str]) -> str:
        if self.to is not None:
            if self.to in avoid:
                raise ValueError(f"the relaunch target {self.to} is draining")
            return self.to
        candidates = [_own_node(), *_alive_nodes()]
        for node in candidates:
            if node not in avoid:
                return node
        raise ValueError(f"no live node outside the draining ones {avoid}")

    def _host(self, kind: str) -> Any:
        return get_host(kind, self.config.server_name(kind), namespace=self.config.namespace)

    async def _placement(self) -> dict[str, str]:
        """kind → node of each host that still answers (a gone one has none to keep)."""
        out: dict[str, str] = {}
        for kind in KIND_ORDER:
            try:
                info: dict[str, Any] = await self._host(kind).ready.remote()
            except Exception:
                continue
            out[kind] = str(info["node_id"])
        return out

    async def __call__(self, hosts: list[str], avoid: list[str]) -> dict[str, str]:
        import ray

        target = self._target(avoid)
        placement = await self._placement()
        placement = {k: (target if n in avoid else n) for k, n in placement.items()}
        for kind in KIND_ORDER:
            with contextlib.suppress(ValueError):  # already gone
                ray.kill(self._host(kind), no_restart=True)
        fleet = self.fleet = await launch_fleet(self.config, placement=placement)
        keys = {actor_name(k, self.config.server_name(k)): k for k in KIND_ORDER}
        return {h: fleet.placement[keys[h]] for h in hosts if h in keys}
