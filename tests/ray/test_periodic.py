"""Periodic checkpoints, retention and `latest` through a real coordinator on
the shared Ray cluster, and bad locations refused before anyone is paused."""

from __future__ import annotations

import contextlib
import pathlib
import time
from collections.abc import Callable
from typing import Any

import pytest
import ray

from coordination import connect
from coordination.client.handle import CoordinatorHandle
from coordination.engine.results import PeriodicStatus
from ray_ckpt.errors import CheckpointConflict, InvalidRequest, ParticipantUnavailable
from ray_ckpt.storage.blobstore.locations import open_location
from ray_ckpt.storage.root.pointer import read_latest
from tests.ray.coord_actors import RecordingHost, start_host

pytestmark = pytest.mark.ray

FLEET = ("environment/env", "agent/agent", "resources/res")


class FlakyHost(RecordingHost):
    """A recording host whose next `n` commits fail (a disk that hiccups)."""

    failing = 0

    async def fail_commits(self, n: int) -> None:
        self.failing = n

    async def commit(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.failing > 0:
            self.failing -= 1
            self.calls.append(("commit", time.time(), time.time(), str(body["checkpoint_id"])))
            raise ParticipantUnavailable("records write failed: EIO (test)")
        return await super().commit(body)


class ScopedAssembler:
    """An assembler that pauses, resumes and says which episodes are in flight."""

    async def pause(self, checkpoint_id: str, deadline_s: float) -> dict[str, int]:
        return {"in_flight": 1}

    async def resume(self, checkpoint_id: str) -> dict[str, bool]:
        return {"resumed": True}

    async def in_flight(self) -> list[str]:
        return ["r1"]


def start_fleet(namespace: str, *, live: list[str] | None = None) -> dict[str, Any]:
    hosts = {k: start_host(namespace, k, live=live) for k in FLEET if k != "agent/agent"}
    hosts["agent/agent"] = (
        ray.remote(FlakyHost)
        .options(name="agent/agent", namespace=namespace, num_cpus=0, max_concurrency=100)
        .remote("agent", "agent", live=live)
    )
    ray.get([h.status.remote() for h in hosts.values()])
    return hosts


def prepares(hosts: dict[str, Any]) -> int:
    logs = ray.get([h.log.remote() for h in hosts.values()])
    return sum(1 for log in logs for c in log["calls"] if c[0] == "prepare")


def wait_for(gym: CoordinatorHandle, done: Callable[[PeriodicStatus], bool]) -> PeriodicStatus:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        # While Ray restarts the coordinator a call can find it unavailable.
        with contextlib.suppress(ParticipantUnavailable):
            st = gym.status().periodic
            if st is not None and done(st):
                return st
        time.sleep(0.2)
    raise AssertionError(f"periodic loop never got there: {gym.status().periodic}")


def test_bad_locations_are_refused_before_anyone_is_paused(
    namespace: str, tmp_path: pathlib.Path
) -> None:
    hosts = start_fleet(namespace, live=["r1"])
    gym = connect(namespace=namespace, state_dir=str(tmp_path / "state"))
    (tmp_path / "file").write_text("a regular file")
    bad = ["relative/ckpt", "s4://bucket/ckpt", f"{tmp_path}/file/ckpt"]
    for where in bad:
        for call in (
            lambda where=where: gym.checkpoint(where),
            lambda where=where: gym.start_periodic(where, every_s=1.0),
            lambda where=where: gym.restore(where, "latest"),
            lambda where=where: gym.restore(where, ["r1"]),
        ):
            with pytest.raises(InvalidRequest) as info:
                call()
            assert where in info.value.detail
    assert prepares(hosts) == 0, "no prepare was sent"
    # Refused for another reason (nothing prepared): no storage touched either.
    with pytest.raises(CheckpointConflict):
        gym.commit(str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()
    assert {r.phase for r in gym.status().participants} == {"idle"}
    assert gym.status().periodic is None


def test_periodic_keeps_the_latest_k_survives_a_failure_and_latest_restores_the_newest(
    namespace: str, tmp_path: pathlib.Path
) -> None:
    hosts = start_fleet(namespace, live=["r1", "r2"])
    gym = connect(namespace=namespace, state_dir=str(tmp_path / "state"))
    assembler = ray.remote(ScopedAssembler).options(namespace=namespace, num_cpus=0).remote()
    gym.register_assembler(assembler, scope_method="in_flight")
    root = str(tmp_path / "ckpts")

    started = gym.start_periodic(root, every_s=1.0, keep_latest_k=2)
    assert started.running
    assert gym.start_periodic(root, every_s=1.0, keep_latest_k=2).root == root  # the same: no-op
    with pytest.raises(CheckpointConflict):
        gym.start_periodic(root, every_s=5.0, keep_latest_k=2)
    wait_for(gym, lambda st: st.completed >= 2)
    ray.get(hosts["agent/agent"].fail_commits.remote(1))
    failed = wait_for(gym, lambda st: st.failed >= 1)
    assert failed.last_error is not None
    assert failed.last_error["code"] == "coordination_failed"
    assert "agent/agent" in failed.last_error["failures"]
    # The next one still runs, and retention keeps going after it.
    after = failed.completed
    wait_for(gym, lambda st: st.completed >= after + 2)
    final = gym.stop_periodic()
    assert final is not None
    assert not final.running
    assert final.failed == 1
    assert final.consecutive_failures == 0
    assert final.deleted >= final.completed - 2
    assert {r.phase for r in gym.status().participants} == {"idle"}

    rows = gym.list_checkpoints(root)
    done = [r for r in rows if r.complete]
    assert len(done) == 2, rows
    # The failed one is incomplete, younger than the grace period: kept, not listed complete.
    # A deleted checkpoint whose records a kept incremental one references (or
    # did, until it was deleted too) stays as records only: no manifest, so no
    # ID and no participants; gc collects it after the grace like any other.
    remains = [r for r in rows if not r.complete and r.checkpoint_id is None]
    assert all(r.participants == 0 for r in remains), rows
    assert [r.name for r in rows if not r.complete and r.checkpoint_id is not None] == [
        failed.last_error["name"]
    ]
    names = [r.name for r in rows]
    assert names == sorted(names), "names sort by time"
    newest = max(done, key=lambda r: r.time)
    assert newest.checkpoint_id == final.last_checkpoint_id
    assert all(r.episodes == 1 for r in done), "the scope is the assembler's in-flight r1"
    pointer = read_latest(open_location(root))
    assert pointer is not None
    assert (pointer.name, pointer.checkpoint_id) == (newest.name, newest.checkpoint_id)

    # A crash: a fresh fleet restores the newest complete checkpoint by "latest".
    for h in hosts.values():
        ray.kill(h, no_restart=True)
    fresh = start_fleet(namespace)  # held: an actor without a handle is gone
    restored = gym.restore(root, "latest")
    assert restored.checkpoint_dir == f"{root}/{newest.name}"
    assert restored.source_checkpoint_id == newest.checkpoint_id
    assert restored.restored == {k: ["r1-a1"] for k in FLEET}
    assert {r.phase for r in gym.status().participants} == {"idle"}
    assert set(fresh) == set(FLEET)


def test_a_restarted_coordinator_runs_the_periodic_loop_again(
    namespace: str, tmp_path: pathlib.Path
) -> None:
    hosts = start_fleet(namespace, live=["r1"])
    gym = connect(namespace=namespace)  # the default journal: Ray's GCS KV store
    root = str(tmp_path / "ckpts")
    first = gym.start_periodic(root, every_s=1.0, keep_latest_k=3)
    wait_for(gym, lambda st: st.completed >= 1)
    ray.kill(gym.actor, no_restart=False)  # Ray restarts it; recovery restarts the loop
    again = wait_for(gym, lambda st: st.started_at > first.started_at and st.completed >= 1)
    assert (again.root, again.every_s, again.keep_latest_k) == (root, 1.0, 3)
    stopped = gym.stop_periodic()
    assert stopped is not None
    assert not stopped.running
    # Stopped is stopped: the next incarnation runs no loop.
    ray.kill(gym.actor, no_restart=False)
    deadline = time.monotonic() + 30
    st = None
    while time.monotonic() < deadline:
        with contextlib.suppress(ParticipantUnavailable):
            st = gym.status()
            break
        time.sleep(0.1)
    assert st is not None
    assert st.periodic is None
    # A coordinator that dies for good (as with its driver) leaves its loop to
    # nobody: a new one under the same name does not inherit it.
    gym.start_periodic(root, every_s=1.0)
    ray.kill(gym.actor, no_restart=True)
    fresh = connect(namespace=namespace)
    assert fresh.status().periodic is None
    ray.kill(fresh.actor, no_restart=False)
    wait_restarted = time.monotonic() + 30
    while time.monotonic() < wait_restarted:
        with contextlib.suppress(ParticipantUnavailable):
            assert fresh.status().periodic is None, "its memory was forgotten"
            break
        time.sleep(0.1)
    assert len(hosts) == len(FLEET)
