"""A real multi-node Ray cluster on this machine, shared by the multi-node tests.

`ray.cluster_utils.Cluster`: a head and two worker nodes, each its own raylet
(loopback only).  The rest of the suite shares one single-node Ray
(`tests/conftest.py`); a driver attaches to one cluster at a time, so the
multi-node tests run last (`tests/conftest.py` orders them) and this fixture
shuts the single-node one down before it starts its own.

A test that removes a node gets a fresh one back from `nodes.ensure_workers()`
at the start of the next test, so each test begins with two live workers.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import E2E

WORKERS = 2
NODE_CPUS = 2
# A custom resource only worker nodes have: an actor asking for a sliver of it
# runs on some worker node and, restarted, on another one.
WORKER = "worker_node"


@dataclass
class Nodes:
    cluster: Any
    head: str  # node ID hex
    workers: dict[str, Any] = field(default_factory=dict)  # node ID hex -> ray Node

    def add_worker(self) -> str:
        node = self.cluster.add_node(num_cpus=NODE_CPUS, resources={WORKER: 1})
        self.cluster.wait_for_nodes()
        self.workers[node.node_id] = node
        _schedulable(str(node.node_id))
        return str(node.node_id)

    def ensure_workers(self, n: int = WORKERS) -> list[str]:
        while len(self.workers) < n:
            self.add_worker()
        return list(self.workers)

    def other(self, node_id: str) -> str:
        """A live worker node that is not `node_id`."""
        return next(n for n in self.workers if n != node_id)

    def remove(self, node_id: str) -> None:
        """The node goes away at once: its raylet and every process on it killed."""
        node = self.workers.pop(node_id)
        self.cluster.remove_node(node, allow_graceful=False)


def _on_node() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def _schedulable(node_id: str) -> None:
    """Run a task pinned to the node: it is up and the scheduler knows it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(_on_node).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    )
    assert ray.get(task.remote(), timeout=60) == node_id


# Package scope: the cluster stops when the multi-node tests are done, before
# the partition suite (tests/partitions) starts its own nodes.
@pytest.fixture(scope="package")
def nodes() -> Iterator[Nodes]:
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()  # the suite's single-node Ray: every test that needed it has run
    # Cluster records its address under Ray's default temp dir; it must exist.
    os.makedirs(os.path.join(tempfile.gettempdir(), "ray"), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="rn", dir="/tmp")  # short: unix socket paths
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": NODE_CPUS, "temp_dir": tmp, "include_dashboard": False},
        shutdown_at_exit=False,
    )
    try:
        ray.init(
            address=cluster.address,
            namespace="ray-ckpt-multinode",
            logging_level="WARNING",
            log_to_driver=False,
        )
        kit = Nodes(cluster, head=ray.get_runtime_context().get_node_id())
        kit.ensure_workers()
        yield kit
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def mn(nodes: Nodes, tmp_path: Path) -> Iterator[E2E]:
    """The e2e kit (fleets, coordinators, baselines) on the multi-node cluster."""
    nodes.ensure_workers()
    kit = E2E(f"mn-{uuid.uuid4().hex[:8]}", tmp_path)
    try:
        yield kit
    finally:
        kit.close()
