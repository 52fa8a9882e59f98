"""A drain whose move fails after its checkpoint: the old hosts run on, the
failure names the checkpoint, and the move is tried again (bounded) while
the node is still draining.  In-process coordinator over real engines."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from coordination.triggers.drain import MOVE_ATTEMPTS, MOVE_BACKOFF_S, DrainWatcher
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import Fleet, make_fleet
from tests.unit.coordination.test_trigger_guard import Actions, OneNode

SCOPE = [EpisodeId("r1")]
NOW = 1_800_000_000.0
PLACEMENT = {
    "environment/env": "nA",
    "agent/agent": "nA",
    "model/policy": "nB",
    "resources/res": "nB",
}


class Clock:
    def __init__(self) -> None:
        self.t = NOW

    def __call__(self) -> float:
        return self.t


class Relauncher:
    """Fails its first `fail` calls (no room elsewhere); then relaunches the
    hosts fresh under their names on node nC."""

    def __init__(self, fleet: Fleet, fail: int) -> None:
        self.fleet = fleet
        self.fail = fail
        self.calls: list[tuple[list[str], list[str]]] = []

    async def __call__(self, hosts: list[str], avoid: list[str]) -> dict[str, str]:
        self.calls.append((hosts, avoid))
        if len(self.calls) <= self.fail:
            raise RuntimeError("no node has room for the hosts")
        for key in hosts:
            self.fleet.add(key)  # a fresh process under the same name
        return dict.fromkeys(hosts, "nC")


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = make_fleet()
    yield f
    await f.aclose()


def setup(fleet: Fleet, fail: int) -> tuple[DrainWatcher, Relauncher, Clock, OneNode]:
    relauncher = Relauncher(fleet, fail)
    clock = Clock()
    source = OneNode({"nA": NOW + 120})
    watch = DrainWatcher(source, Actions(fleet, PLACEMENT, relauncher), "/ck", wall=clock)
    return watch, relauncher, clock, source


def open_and_idle(fleet: Fleet) -> bool:
    live = [k for k in fleet.core.hosts]
    return (
        fleet.core.open is None
        and all(fleet.ctrls[k].state.phase.value == "idle" for k in live)
        and all(fleet.parts[k].admission_open for k in live)
    )


async def test_a_failed_relaunch_resumes_the_old_hosts_and_the_move_is_retried(
    fleet: Fleet,
) -> None:
    await fleet.core.checkpoint("/ck/0", SCOPE)
    watch, relauncher, clock, _ = setup(fleet, fail=1)
    first = await watch.poll_once()
    assert first is not None
    assert not first.ok
    assert first.error is not None
    assert "no node has room" in first.error["detail"]
    # The drain's checkpoint is complete and named.
    drain_dir, drain_cid, _ = fleet.manifests[-1]
    assert first.checkpoint_id == drain_cid
    assert first.location == drain_dir
    assert first.attempt == 1
    assert first.retry_at == NOW + MOVE_BACKOFF_S
    # Nothing is left committed: the old hosts run on and take checkpoints.
    assert open_and_idle(fleet)
    await fleet.core.checkpoint("/ck/after", SCOPE)
    assert fleet.manifests[-1][0] == "/ck/after"
    # Not before the backoff ...
    clock.t = NOW + MOVE_BACKOFF_S / 2
    assert await watch.poll_once() is None
    assert len(relauncher.calls) == 1
    # ... then the whole drain again: a fresh checkpoint, the move, the restore.
    clock.t = NOW + MOVE_BACKOFF_S
    second = await watch.poll_once()
    assert second is not None
    assert second.ok, second.error
    assert second.attempt == 2
    assert second.moved == {"agent/agent": "nC", "environment/env": "nC"}
    assert second.checkpoint_id == fleet.manifests[-1][1] != drain_cid
    assert relauncher.calls[-1] == (["agent/agent", "environment/env"], ["nA"])
    assert open_and_idle(fleet)
    # Moved: not handled again.
    clock.t += 60
    assert await watch.poll_once() is None
    assert len(relauncher.calls) == 2


async def test_the_retries_are_bounded_and_back_off(fleet: Fleet) -> None:
    await fleet.core.checkpoint("/ck/0", SCOPE)
    watch, relauncher, clock, _ = setup(fleet, fail=10)
    outs, when = [], []
    for _ in range(40):
        out = await watch.poll_once()
        if out is not None:
            outs.append(out)
            when.append(clock.t)
        clock.t += 0.5
    assert [o.attempt for o in outs] == list(range(1, MOVE_ATTEMPTS + 1))
    assert len(relauncher.calls) == MOVE_ATTEMPTS
    assert all(o.checkpoint_id for o in outs)
    waits = [o.retry_at - t for o, t in zip(outs[:-1], when, strict=False) if o.retry_at]
    assert waits == [MOVE_BACKOFF_S * 2**i for i in range(MOVE_ATTEMPTS - 1)]
    assert outs[-1].retry_at is None  # spent: reported, not retried
    assert watch.retries == []
    assert open_and_idle(fleet)


async def test_no_retry_once_the_node_no_longer_drains(fleet: Fleet) -> None:
    await fleet.core.checkpoint("/ck/0", SCOPE)
    watch, relauncher, clock, source = setup(fleet, fail=1)
    first = await watch.poll_once()
    assert first is not None
    assert first.retry_at is not None
    source.now = {}  # the drain was called off
    clock.t = first.retry_at
    assert await watch.poll_once() is None
    assert len(relauncher.calls) == 1
    assert watch.retries == []
    assert open_and_idle(fleet)


async def test_a_failed_restore_is_retried_from_the_same_checkpoint(fleet: Fleet) -> None:
    await fleet.core.checkpoint("/ck/0", SCOPE)
    watch, relauncher, clock, _ = setup(fleet, fail=0)
    actions = watch.actions
    assert isinstance(actions, Actions)
    restores: list[str] = []
    real = actions.restore

    async def flaky(location: str) -> object:
        restores.append(location)
        if len(restores) == 1:
            raise RuntimeError("restore failed")
        return await real(location)

    actions.restore = flaky  # type: ignore[method-assign]
    first = await watch.poll_once()
    assert first is not None
    assert not first.ok
    assert first.retry_at is not None
    assert first.moved == {"agent/agent": "nC", "environment/env": "nC"}
    clock.t = first.retry_at
    second = await watch.poll_once()
    assert second is not None
    assert second.ok, second.error
    assert second.attempt == 2
    assert restores == [first.location, first.location]
    assert second.checkpoint_id == first.checkpoint_id
    assert len(relauncher.calls) == 1  # moved once
