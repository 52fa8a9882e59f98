"""Where the main job runs: an embedded Ray of one or several local nodes.

`ray-ckpt demo --nodes N` with no `--address` starts a head and N-1 worker
nodes on this machine (`ray.cluster_utils.Cluster`: each node its own
raylet, loopback only) and spreads the fleet over them: the environment and
agent hosts on a worker (the *edge*, never the coordinator's node), the policy
model and resources hosts on another worker, or on the head when there is
only one.
`--kill-node` removes the edge node after the checkpoint (every process on
it dies at once) and the lost hosts come back on the head.  `node_of` asks an
actor which node it runs on; `kill_coordinator` ends the coordinator actor
the job started when the job ends.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

EDGE = ("environment", "agent")
CORE = ("model", "resources")
NODE_CPUS = 2


@dataclass
class LocalRay:
    """The Ray this job attached to or started (and must stop)."""

    started: bool
    cluster: Any = None  # ray.cluster_utils.Cluster when it started several nodes
    head: str = ""
    workers: list[Any] = field(default_factory=list)  # ray Node objects, in order
    edge: Any = None  # the worker `placement` chose for the environment and agent

    @property
    def nodes(self) -> int:
        return 1 + len(self.workers)

    def placement(self, avoid: str | None = None) -> dict[str, str]:
        """kind -> node ID: the edge on a worker other than `avoid` (the
        coordinator's node: the node this job loses is a Gym node), the core
        on another worker or the head.  Empty on one node: every host on the
        driver's."""
        if not self.workers:
            return {}
        ranked = sorted(self.workers, key=lambda n: str(n.node_id) == avoid)
        self.edge = ranked[0]
        others = [str(n.node_id) for n in ranked[1:]]
        edge = str(self.edge.node_id)
        core = others[0] if others else self.head
        return {**dict.fromkeys(EDGE, edge), **dict.fromkeys(CORE, core)}

    def kill_edge(self) -> str:
        """Remove the edge node now (no graceful shutdown); its node ID."""
        node = self.edge if self.edge is not None else self.workers[0]
        self.workers.remove(node)
        self.edge = None
        self.cluster.remove_node(node, allow_graceful=False)
        return str(node.node_id)

    def after_loss(self, before: dict[str, str], lost: str) -> dict[str, str]:
        """The same placement with every host of the lost node on the head."""
        return {k: (self.head if n == lost else n) for k, n in before.items()}

    def stop(self) -> None:
        import ray

        if self.started:
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()


def start_ray(address: str | None, namespace: str, nodes: int = 1) -> LocalRay:
    """Attach to `address`, or start an embedded local Ray of `nodes` nodes."""
    import ray

    if address is not None:
        ray.init(address=address, namespace=namespace, log_to_driver=False)
        return LocalRay(started=False)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    # Unix socket paths are limited to ~107 chars: a short temp dir.
    temp_dir = tempfile.mkdtemp(prefix="rcd", dir="/tmp")
    if nodes <= 1:
        ray.init(
            num_cpus=NODE_CPUS,
            include_dashboard=False,
            namespace=namespace,
            _temp_dir=temp_dir,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
        return LocalRay(started=True)
    from ray.cluster_utils import Cluster

    # Cluster records its address under Ray's default temp dir; it must exist.
    os.makedirs(os.path.join(tempfile.gettempdir(), "ray"), exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": NODE_CPUS, "temp_dir": temp_dir, "include_dashboard": False},
        shutdown_at_exit=True,
    )
    local = LocalRay(started=True, cluster=cluster)
    try:
        local.workers = [cluster.add_node(num_cpus=NODE_CPUS) for _ in range(nodes - 1)]
        cluster.wait_for_nodes()
        ray.init(
            address=cluster.address,
            namespace=namespace,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
        local.head = str(ray.get_runtime_context().get_node_id())
    except BaseException:
        local.stop()
        raise
    return local


def _node_of(_self: Any) -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


async def node_of(actor: Any) -> str:
    """The node an actor runs on, asked of the actor itself."""
    return str(await actor.__ray_call__.remote(_node_of))


def kill_coordinator(handle: Any) -> None:
    """Stop the coordinator actor the job started, for good (no restart)."""
    import ray

    ray.kill(handle.actor, no_restart=True)
