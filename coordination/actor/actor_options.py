"""How the `Coordinator` actor is named and with which Ray options: one per namespace.

Separate from the actor class so the handle and tools can name and find the
coordinator without importing what it runs (`connect.get_or_create_coordinator`
creates it).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from ray_ckpt.errors import InvalidRequest

COORDINATOR_NAME = "ray-ckpt-coordinator"
MAX_CONCURRENCY = 1000


def default_state_dir(namespace: str, name: str = COORDINATOR_NAME) -> str:
    """A node-local directory for a file journal (opt-in: `state_dir=`); the
    default journal is in Ray's GCS KV store."""
    return os.path.join(tempfile.gettempdir(), "ray-ckpt", namespace, name)


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
