"""`RayDrainSource` against a real drain: `ray drain-node --reason
DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N` on a worker of
the shared multi-node cluster shows up as that node with its deadline (the
private call `coordination.drain` depends on, checked on this Ray)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from coordination.drain import RayDrainSource, plan_drain
from tests.multinode.conftest import Nodes

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _node() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


def test_a_preemption_drain_shows_up_with_its_deadline(nodes: Nodes) -> None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    worker = nodes.ensure_workers()[0]
    # Something on the node, as a Gym host would be (an idle node just goes).
    busy: Any = (
        ray.remote(num_cpus=0)(_Busy)
        .options(scheduling_strategy=NodeAffinitySchedulingStrategy(worker, soft=False))
        .remote()
    )
    assert ray.get(busy.node.remote(), timeout=60) == worker
    assert worker not in RayDrainSource().draining()
    sent = time.time()
    run = subprocess.run(
        [
            str(Path(sys.executable).with_name("ray")),
            "drain-node",
            *("--address", nodes.cluster.address, "--node-id", worker),
            *("--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot"),
            *("--deadline-remaining-seconds", "30"),
        ],
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    try:
        assert run.returncode == 0, run.stderr[-2000:]
        draining = RayDrainSource().draining()
        for _ in range(100):  # the GCS learns it from the raylet a moment later
            if worker in draining:
                break
            time.sleep(0.1)
            draining = RayDrainSource().draining()
        assert worker in draining, draining
        deadline = draining[worker]
        assert deadline is not None
        assert sent + 29 <= deadline <= time.time() + 31
        plan = plan_drain(draining, {"environment": worker}, set(), time.time())
        assert plan is not None
        assert plan.hosts == ["environment"]
        assert 25 < plan.budget_s < 30
    finally:
        ray.kill(busy)
        # A draining node takes no new work: the next test gets a fresh one.
        nodes.remove(worker)


class _Busy:
    def node(self) -> str:
        return _node()
