"""The Coordinator actor on a real Ray cluster (shared session cluster)."""

from __future__ import annotations

import contextlib
import pathlib
import time
from typing import Any

import pytest
import ray

from coordination import connect
from ray_ckpt.errors import CoordinationFailed, ParticipantUnavailable, StaleCheckpoint
from ray_ckpt.storage import read_gym_manifest
from tests.ray.coord_actors import start_controlled, start_host

pytestmark = pytest.mark.ray

FLEET = (
    "environment/env-a",
    "environment/env-b",
    "model/policy",
    "agent/agent",
    "resources/res",
)


def calls(handle: Any, op: str) -> list[tuple[str, float, float, str]]:
    return [c for c in ray.get(handle.log.remote())["calls"] if c[0] == op]


def test_checkpoint_order_parallel_groups_pause_and_restore(
    namespace: str, tmp_path: pathlib.Path
) -> None:
    hosts = {
        k: start_host(
            namespace, k, delay={"prepare": 0.4} if k.startswith("env") else None, live=["r1"]
        )
        for k in FLEET
    }
    ray.get([h.status.remote() for h in hosts.values()])
    gym = connect(namespace=namespace, state_dir=str(tmp_path / "state"))
    trainer, assembler = start_controlled(namespace), start_controlled(namespace)
    gym.register_trainer(trainer)
    gym.register_assembler(assembler)

    ckpt = tmp_path / "ckpt"
    result = gym.checkpoint(str(ckpt), scope=["r1"])
    assert set(result.timings) == set(FLEET)
    assert result.episode_ids["agent/agent"] == ["r1"]
    assert result.total_bytes > 0
    listed = {(e.kind, e.instance) for e in read_gym_manifest(ckpt).participants}
    assert listed == {tuple(k.split("/")) for k in FLEET}

    prep = {k: calls(h, "prepare")[0] for k, h in hosts.items()}
    # Groups in order: every environment answered before the policy was called, ...
    env_end = max(prep[k][2] for k in FLEET[:2])
    assert env_end <= prep["model/policy"][1]
    assert prep["model/policy"][2] <= prep["agent/agent"][1]
    assert prep["agent/agent"][2] <= prep["resources/res"][1]
    # ... and the two environments ran together (each takes 0.4 s): each was
    # called before the other answered.
    assert max(prep[k][1] for k in FLEET[:2]) < min(prep[k][2] for k in FLEET[:2])
    res = {k: calls(h, "resume")[0] for k, h in hosts.items()}
    assert res["resources/res"][2] <= res["agent/agent"][1]
    assert res["model/policy"][2] <= min(res[k][1] for k in FLEET[:2])
    # Trainer and assembler paused before the first prepare, resumed after the last resume.
    first_prepare = min(c[1] for c in prep.values())
    last_resume = max(c[2] for c in res.values())
    for actor in (trainer, assembler):
        events = ray.get(actor.log.remote())
        assert [e[0] for e in events] == ["pause", "resume"]
        assert events[0][1] <= first_prepare
        assert events[1][1] >= last_resume
        assert {e[2] for e in events} == {result.checkpoint_id}

    # A crash: every host is replaced by a fresh one; the new fleet restores.
    for h in hosts.values():
        ray.kill(h, no_restart=True)
    fresh = {k: start_host(namespace, k) for k in FLEET}
    ray.get([h.status.remote() for h in fresh.values()])
    restored = gym.restore(str(ckpt), ["r1"])
    assert restored.source_checkpoint_id == result.checkpoint_id
    assert restored.restored == {k: ["r1-a1"] for k in FLEET}
    assert {r.phase for r in gym.status().participants} == {"idle"}

    # All or nothing: a second fresh fleet where one host fails its restore.
    for h in fresh.values():
        ray.kill(h, no_restart=True)
    again = {k: start_host(namespace, k, fail_restore=(k == "agent/agent")) for k in FLEET}
    ray.get([h.status.remote() for h in again.values()])
    with pytest.raises(CoordinationFailed) as info:
        gym.restore(str(ckpt), ["r1"])
    assert set(info.value.failures) == {"agent/agent"}
    for key, h in again.items():
        retired = calls(h, "retire")
        assert len(retired) == 1, key
        assert ray.get(h.log.remote())["restored"] == {}, "what was installed is discarded"
    assert {r.phase for r in gym.status().participants} == {"idle"}


def test_a_straggler_is_cancelled_and_a_dead_host_is_named(
    namespace: str, tmp_path: pathlib.Path
) -> None:
    hosts = {
        "environment/env": start_host(namespace, "environment/env"),
        "agent/slow": start_host(namespace, "agent/slow", delay={"prepare": 30.0}),
        "resources/res": start_host(namespace, "resources/res"),
    }
    ray.get([h.status.remote() for h in hosts.values()])
    gym = connect(
        namespace=namespace,
        state_dir=str(tmp_path / "state"),
        timeouts={"prepare_s": 0.5, "reply_grace_s": 0.2},
    )
    start = time.monotonic()
    with pytest.raises(CoordinationFailed) as info:
        gym.checkpoint(str(tmp_path / "c1"))
    assert time.monotonic() - start < 10
    assert info.value.failures["agent/slow"]["code"] == "deadline_exceeded"
    assert ray.get(hosts["agent/slow"].log.remote())["cancelled"] == ["prepare"]
    assert calls(hosts["resources/res"], "prepare") == [], "stopped at the first unready group"
    assert {r.phase for r in gym.status().participants} == {"idle"}

    # Killed: the discovery before the next checkpoint drops its name (a member
    # dying inside a prepare fails it by name: tests/ray/test_coord_membership.py).
    ray.kill(hosts["agent/slow"], no_restart=True)
    result = gym.checkpoint(str(tmp_path / "c2"))
    assert set(result.timings) == {"environment/env", "resources/res"}
    assert (
        calls(hosts["environment/env"], "resume")[-1][3]
        == calls(hosts["environment/env"], "prepare")[-1][3]
    )


def test_coordinator_killed_mid_checkpoint_leases_lapse_and_a_new_one_takes_over(
    namespace: str, tmp_path: pathlib.Path
) -> None:
    keys = ("environment/env", "model/p", "agent/a")
    hosts = {k: start_host(namespace, k, lease_grace_s=1.0) for k in keys}
    ray.get([h.status.remote() for h in hosts.values()])
    gym = connect(namespace=namespace, state_dir=str(tmp_path / "a"), name="coord-a")
    prepared = gym.prepare(deadline_s=0.5)
    assert {r.phase for r in gym.status().participants} == {"prepared"}
    ray.kill(gym.actor, no_restart=True)

    # Nobody resumes them: each participant's lease lapses and it resumes itself.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        phases = {ray.get(h.status.remote())["phase"] for h in hosts.values()}
        if phases == {"idle"}:
            break
        time.sleep(0.2)
    assert phases == {"idle"}

    other = connect(namespace=namespace, state_dir=str(tmp_path / "b"), name="coord-b")
    result = other.checkpoint(str(tmp_path / "ck"))
    assert result.checkpoint_id != prepared.checkpoint_id
    # The dead coordinator's delayed commit is refused by fencing.
    body = {
        "checkpoint_id": prepared.checkpoint_id,
        "deadline_ts": time.time() + 5,
        "checkpoint_dir": str(tmp_path / "late"),
    }
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(hosts["agent/a"].commit.remote(body))
    assert isinstance(info.value.cause, StaleCheckpoint)

    # A coordinator Ray restarts recovers from its journal: it aborts the open checkpoint.
    opened = other.prepare()
    ray.kill(other.actor, no_restart=False)
    recovered = None
    deadline = time.monotonic() + 30
    while recovered is None and time.monotonic() < deadline:
        # The kill is asynchronous: the old incarnation may still answer first.
        with contextlib.suppress(ParticipantUnavailable):
            recovered = other.ping()
        time.sleep(0.1)
    assert recovered == opened.checkpoint_id
    assert {ray.get(h.status.remote())["phase"] for h in hosts.values()} == {"idle"}


def test_an_actor_reporting_another_kind_is_refused_at_registration(
    namespace: str, tmp_path: pathlib.Path
) -> None:
    from ray_ckpt.errors import InvalidRequest
    from tests.ray.coord_actors import RecordingHost

    honest = start_host(namespace, "environment/env")
    # Named as an agent, but its status says resources.
    liar = (
        ray.remote(RecordingHost)
        .options(name="agent/liar", namespace=namespace, num_cpus=0)
        .remote("resources", "liar")
    )
    ray.get([honest.status.remote(), liar.status.remote()])
    gym = connect(namespace=namespace, state_dir=str(tmp_path / "state"))
    with pytest.raises(InvalidRequest, match="agent/liar reports kind 'resources'"):
        gym.discover()
    with pytest.raises(InvalidRequest, match="register it as resources/liar"):
        gym.register_actor("agent", "liar", liar)
    # Every discovery (each prepare, status) fails naming it until it is gone.
    with pytest.raises(InvalidRequest, match="agent/liar"):
        gym.prepare()
    ray.kill(liar)
    deadline = time.monotonic() + 30
    while True:
        try:
            rows = gym.status().participants
            break
        except InvalidRequest:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert [p.participant for p in rows] == ["environment/env"]
