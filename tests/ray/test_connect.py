"""connect() hands out a live coordinator even right after its creator exited."""

from __future__ import annotations

import subprocess
import sys

import pytest

from coordination.client.connect import connect

pytestmark = pytest.mark.ray

CREATE_AND_EXIT = """
import sys, ray
from coordination.client.connect import connect
ray.init(address=sys.argv[1], namespace=sys.argv[2], log_to_driver=False)
gym = connect(namespace=sys.argv[2])
print(gym.ping())
"""


def test_connect_after_the_creating_driver_exited(ray_session: str, namespace: str) -> None:
    import ray

    address = ray.get_runtime_context().gcs_address
    for round_ in range(3):
        # A driver (like one `ray-ckpt` command) creates the namespace's
        # coordinator, which is not detached, and exits: the actor dies with it.
        out = subprocess.run(
            [sys.executable, "-c", CREATE_AND_EXIT, address, namespace],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        # Right after, this driver must get a coordinator that answers.
        gym = connect(namespace=namespace)
        assert gym.status().participants == [], round_
        ray.kill(gym.actor, no_restart=True)
