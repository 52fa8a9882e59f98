"""Membership on real Ray: frozen at prepare, dead names pruned."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import ray

from coordination import connect
from ray_ckpt.errors import CoordinationFailed
from tests.actors import wait_dead
from tests.ray.coord_actors import start_host

pytestmark = pytest.mark.ray


def ops(handle: Any) -> list[str]:
    return [c[0] for c in ray.get(handle.log.remote())["calls"]]


def test_a_host_started_while_a_checkpoint_is_open_joins_the_next_one(
    namespace: str, tmp_path: pathlib.Path
) -> None:
    hosts = {k: start_host(namespace, k, live=["r1"]) for k in ("environment/e", "agent/a")}
    ray.get([h.status.remote() for h in hosts.values()])
    gym = connect(namespace=namespace, state_dir=str(tmp_path / "state"))
    late = None
    try:
        prepared = gym.prepare()
        late = start_host(namespace, "agent/late")
        ray.get(late.status.remote())
        # status() and discover() see it, and leave the open checkpoint alone.
        status = gym.status()
        assert "agent/late" in {r.participant for r in status.participants}
        assert "agent/late" in gym.discover()
        assert gym.status().open_checkpoint == prepared.checkpoint_id
        committed = gym.commit(str(tmp_path / "ck"), ["r1"])
        assert set(committed.timings) == set(hosts)
        assert gym.resume().failures == {}
        assert ops(late) == []

        result = gym.checkpoint(str(tmp_path / "ck2"), ["r1"])
        assert set(result.timings) == set(hosts) | {"agent/late"}
    finally:
        ray.kill(gym.actor, no_restart=True)
        for h in [*hosts.values(), late]:
            if h is not None:
                ray.kill(h, no_restart=True)


def test_discover_drops_a_member_whose_actor_is_gone(
    namespace: str, tmp_path: pathlib.Path
) -> None:
    keys = ("environment/e", "agent/a", "agent/b")
    hosts = {k: start_host(namespace, k) for k in keys}
    ray.get([h.status.remote() for h in hosts.values()])
    gym = connect(namespace=namespace, state_dir=str(tmp_path / "state"))
    try:
        assert gym.discover() == sorted(keys)
        ray.kill(hosts["agent/b"], no_restart=True)
        assert gym.discover() == ["agent/a", "environment/e"]
        result = gym.checkpoint(str(tmp_path / "ck"))
        assert set(result.timings) == {"agent/a", "environment/e"}
    finally:
        ray.kill(gym.actor, no_restart=True)
        for h in hosts.values():
            ray.kill(h, no_restart=True)


def test_a_member_dead_at_prepare_fails_it_by_name_and_is_gone_from_the_next(
    namespace: str, tmp_path: pathlib.Path
) -> None:
    keys = ("environment/e", "agent/a")
    hosts = {k: start_host(namespace, k) for k in keys}
    ray.get([h.status.remote() for h in hosts.values()])
    # No discovery before each call: the dead actor is found by the prepare itself.
    gym = connect(namespace=namespace, state_dir=str(tmp_path / "state"), auto_discover=False)
    try:
        for key in keys:
            gym.register_actor(*key.split("/"))
        ray.kill(hosts["agent/a"], no_restart=True)
        wait_dead(hosts["agent/a"])
        with pytest.raises(CoordinationFailed) as info:
            gym.prepare()
        assert set(info.value.failures) == {"agent/a"}
        assert info.value.failures["agent/a"]["code"] == "participant_unavailable"
        assert "agent/a" in str(info.value)
        assert [r.participant for r in gym.status().participants] == ["environment/e"]
        result = gym.checkpoint(str(tmp_path / "ck"))
        assert set(result.timings) == {"environment/e"}
    finally:
        ray.kill(gym.actor, no_restart=True)
        ray.kill(hosts["environment/e"], no_restart=True)
