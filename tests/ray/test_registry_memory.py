"""A coordinator that Ray restarts keeps what was registered by hand.

An HTTP-only participant (URL and token: the coordinator cannot find it by
name) and the trainer and assembler pause targets are registered once; the
coordinator actor is killed and Ray restarts it (`max_restarts=-1`).  With
no second registration, the restarted one lists the HTTP member, checkpoints
it, and pauses and resumes the trainer and the assembler.  A coordinator
created anew under the same name (a later job) starts empty.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import time
from typing import Any

import pytest
import ray

from coordination.client.connect import connect
from ray_ckpt.gym_server.spec import ServerSpec, settings_dict
from ray_ckpt.hosting.host import start_host, stop_host
from ray_ckpt.settings import CheckpointSettings
from tests.ray.coord_actors import start_controlled

pytestmark = pytest.mark.ray

TOKEN = "registry-test-token"
SETTINGS = settings_dict(
    CheckpointSettings.model_validate(
        {"enabled": True, "control_auth_token": TOKEN, "lease_grace_seconds": 60}
    )
)


def pauses(actor: Any) -> int:
    return sum(1 for e in ray.get(actor.log.remote()) if e[0] == "pause")


def _pid(_self: Any) -> int:
    return os.getpid()


def pid_of(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(_pid), timeout=30))


def wait_restarted(gym: Any, old_pid: int, timeout_s: float = 60.0) -> None:
    """Until a new process answers (a call right after the kill may still
    reach the old one) and has recovered."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if pid_of(gym.actor) != old_pid:
                gym.ping()
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError("the coordinator was not restarted")
        time.sleep(0.2)


def test_http_members_and_pause_targets_survive_a_coordinator_restart(
    namespace: str, tmp_path: pathlib.Path
) -> None:
    # HTTP only: a host in another namespace, registered by URL and token alone.
    far = start_host(
        ServerSpec(
            kind="resources",
            name="far",
            factory="tests.servers:fastapi_server",
            options={"kind": "resources"},
            settings=SETTINGS,
        ),
        namespace=f"{namespace}-far",
    )
    gym = None
    try:
        url = ray.get(far.ready.remote())["url"]
        gym = connect(namespace=namespace)  # journal and registrations in the GCS
        gym.register_http("resources", "far", url, TOKEN)
        trainer, assembler = start_controlled(namespace), start_controlled(namespace)
        gym.register_trainer(trainer)
        gym.register_assembler(assembler)
        gym.checkpoint(str(tmp_path / "c1"))
        assert (pauses(trainer), pauses(assembler)) == (1, 1)

        old_pid = pid_of(gym.actor)
        ray.kill(gym.actor, no_restart=False)  # Ray restarts it: __init__ runs again
        wait_restarted(gym, old_pid)
        assert [p.participant for p in gym.status().participants] == ["resources/far"]
        result = gym.checkpoint(str(tmp_path / "c2"))
        assert set(result.episode_ids) == {"resources/far"}
        assert (pauses(trainer), pauses(assembler)) == (2, 2)
        assert {p.phase for p in gym.status().participants} == {"idle"}

        # A new coordinator under the name (not a restart) inherits nothing.
        ray.kill(gym.actor, no_restart=True)
        fresh = connect(namespace=namespace)
        gym = fresh
        assert fresh.status().participants == []
    finally:
        if gym is not None:
            ray.kill(gym.actor, no_restart=True)
        asyncio.run(stop_host(far, timeout_s=5))
