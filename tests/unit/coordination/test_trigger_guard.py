"""Every trigger no person started is checked against the Gym of the last
complete checkpoint: only a manual checkpoint may change the membership.

A drain notice after a member died must not checkpoint the survivors: that
checkpoint would become `latest`, re-baseline the guard on the partial Gym,
and let the periodic loop's `keep_latest_k` delete the last checkpoint of the
whole Gym."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from coordination.actor.drain_control import CoordinatorDrainActions
from coordination.engine.baseline import Trigger, attended
from coordination.engine.metrics import TRIGGERS
from coordination.triggers.drain import DrainWatcher
from ray_ckpt.errors import CoordinationFailed, MembershipChanged
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import Fleet, make_fleet

SCOPE = [EpisodeId("r1")]
NOW = 1_800_000_000.0


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = make_fleet()
    yield f
    await f.aclose()


def test_the_metrics_labels_are_the_triggers() -> None:
    assert set(TRIGGERS) == {t.value for t in Trigger}


def test_only_manual_is_attended_and_an_unknown_trigger_is_not() -> None:
    assert [t for t in Trigger if attended(t)] == [Trigger.MANUAL]
    assert attended("manual")
    assert not attended("nightly")  # a trigger nobody listed: unattended by default


@pytest.mark.parametrize("trigger", [*Trigger, "nightly"])
async def test_every_trigger_through_the_guard(fleet: Fleet, trigger: str) -> None:
    await fleet.core.checkpoint("/ck/1", SCOPE)
    fleet.core.unregister("agent/agent")  # its actor died; discovery dropped it
    prepares = len(fleet.events("prepare"))
    if attended(trigger):
        await fleet.core.checkpoint("/ck/2", SCOPE, trigger=trigger)
        assert [m[0] for m in fleet.manifests] == ["/ck/1", "/ck/2"]
        return
    with pytest.raises(MembershipChanged, match="gone: agent/agent"):
        await fleet.core.checkpoint("/ck/2", SCOPE, trigger=trigger, stop=True, resume=False)
    assert len(fleet.events("prepare")) == prepares, "nobody was paused"
    assert [m[0] for m in fleet.manifests] == ["/ck/1"]
    assert [d for d, _ in fleet.latests] == ["/ck/1"]


class OneNode:
    def __init__(self, draining: dict[str, float | None]) -> None:
        self.now = draining

    def draining(self) -> dict[str, float | None]:
        return dict(self.now)


class InProcess:
    """What `CoordinatorDrainActions` asks of the `Coordinator`, over a core."""

    def __init__(self, fleet: Fleet) -> None:
        self.core = fleet.core

        async def scope() -> list[EpisodeId]:
            return list(SCOPE)

        self.scope_source = scope

    async def _ready(self, *, discover: bool = False) -> None:
        return None

    async def restore(self, location: str) -> Any:
        return await self.core.restore(location, SCOPE)


class Actions(CoordinatorDrainActions):
    """The coordinator's drain actions; placement fixed (FakeHosts have no Ray node)."""

    def __init__(self, fleet: Fleet, placement: dict[str, str], relaunch: Any) -> None:
        super().__init__(cast(Any, InProcess(fleet)), relaunch)
        self.where = placement

    async def placement(self) -> dict[str, str]:
        return {k: n for k, n in self.where.items() if k in self.coordinator.core.hosts}


async def test_a_drain_after_a_member_died_is_refused_and_publishes_nothing(
    fleet: Fleet,
) -> None:
    await fleet.core.checkpoint("/ck/full", SCOPE, trigger="periodic")
    fleet.core.unregister("agent/agent")
    relaunched: list[list[str]] = []

    async def relaunch(hosts: list[str], avoid: list[str]) -> dict[str, str]:
        relaunched.append(hosts)
        return dict.fromkeys(hosts, "nC")

    placement = {"environment/env": "nA", "agent/agent": "nA", "model/policy": "nB"}
    watch = DrainWatcher(
        OneNode({"nA": NOW + 60}),
        Actions(fleet, placement, relaunch),
        "/ck",
        wall=lambda: NOW,
    )
    out = await watch.poll_once()
    assert out is not None
    assert not out.ok
    assert out.error is not None
    assert out.error["code"] == "membership_changed"
    assert out.checkpoint_id is None
    assert relaunched == []
    # Nothing published, nobody left paused or committed.
    assert [m[0] for m in fleet.manifests] == ["/ck/full"]
    assert [d for d, _ in fleet.latests] == ["/ck/full"]
    assert fleet.core.open is None
    live = {k: v for k, v in fleet.phases().items() if k in fleet.core.hosts}
    assert set(live.values()) == {"idle"}
    assert all(p.admission_open for p in fleet.parts.values())
    # The baseline is still the whole Gym: the periodic loop stays refused.
    with pytest.raises(MembershipChanged):
        await fleet.core.checkpoint("/ck/p", SCOPE, trigger="periodic")
    # The refused drain is reported once, not attempted on every poll.
    assert await watch.poll_once() is None
    assert watch.handled == {"nA"}


@pytest.mark.parametrize("trigger", [t for t in Trigger if not attended(t)])
async def test_a_member_lost_before_anything_completed_refuses_unattended_checkpoints(
    fleet: Fleet, trigger: str
) -> None:
    """No complete checkpoint yet, so no baseline: a member whose process is
    found gone still makes the Gym another one.  Found by the seeded
    simulation: a periodic checkpoint after a death, before the first
    complete checkpoint, published the survivors as `latest`."""
    fleet.hosts["agent/agent"].dead = True
    with pytest.raises(CoordinationFailed):
        await fleet.core.checkpoint("/ck/1", SCOPE, trigger=trigger)  # finds it gone
    assert "agent/agent" not in fleet.core.hosts
    prepares = len(fleet.events("prepare"))
    with pytest.raises(MembershipChanged, match="gone: agent/agent"):
        await fleet.core.checkpoint("/ck/2", SCOPE, trigger=trigger)
    assert len(fleet.events("prepare")) == prepares, "nobody was paused"
    # A relaunch under the same name holds nothing of what was lost.
    fleet.add("agent/agent")
    with pytest.raises(MembershipChanged, match="gone: agent/agent"):
        await fleet.core.checkpoint("/ck/3", SCOPE, trigger=trigger)
    assert fleet.manifests == [] and fleet.latests == []
    # A person accepts the Gym as it is; unattended ones go on from there.
    await fleet.core.checkpoint("/ck/4", SCOPE)
    await fleet.core.checkpoint("/ck/5", SCOPE, trigger=trigger)
    assert [m[0] for m in fleet.manifests] == ["/ck/4", "/ck/5"]
