"""An unattended checkpoint (periodic, signal) is refused while the Gym lost
or replaced a member since its last complete checkpoint or restore: it would
publish another Gym as `latest`.  A manual checkpoint accepts the Gym as it is."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from coordination.engine.baseline import GymBaseline
from ray_ckpt.errors import MembershipChanged
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import Fleet, make_fleet

SCOPE = [EpisodeId("r1")]


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = make_fleet()
    yield f
    await f.aclose()


async def test_nothing_complete_yet_nothing_to_compare(fleet: Fleet) -> None:
    fleet.core.unregister("agent/agent")
    await fleet.core.checkpoint("/ck/p", SCOPE, trigger="periodic")


async def test_a_member_gone_refuses_unattended_checkpoints_until_a_manual_one(
    fleet: Fleet,
) -> None:
    await fleet.core.checkpoint("/ck/1", SCOPE, trigger="periodic")
    fleet.core.unregister("agent/agent")  # its actor died; discovery dropped it
    prepares = len(fleet.events("prepare"))
    for trigger in ("periodic", "signal"):
        with pytest.raises(MembershipChanged, match="gone: agent/agent"):
            await fleet.core.checkpoint("/ck/2", SCOPE, trigger=trigger)
    assert len(fleet.events("prepare")) == prepares, "nobody was paused"
    assert len(fleet.manifests) == 1
    await fleet.core.checkpoint("/ck/3", SCOPE)  # manual: the Gym as it is now
    await fleet.core.checkpoint("/ck/4", SCOPE, trigger="periodic")
    assert [m[0] for m in fleet.manifests] == ["/ck/1", "/ck/3", "/ck/4"]


async def test_a_member_replaced_by_a_fresh_process_refuses_them_too(fleet: Fleet) -> None:
    await fleet.core.checkpoint("/ck/1", SCOPE)
    fleet.add("model/policy")  # relaunched under the same name: another process
    with pytest.raises(MembershipChanged, match="replaced: model/policy"):
        await fleet.core.checkpoint("/ck/2", SCOPE, trigger="periodic")
    # A host that only joins is no loss: the last checkpoint's members are all there.
    baseline = GymBaseline()
    baseline.record(fleet.hosts)
    baseline.check({**fleet.hosts, "resources/extra": object()}, "periodic")


async def test_a_restore_accepts_the_restored_gym(fleet: Fleet) -> None:
    fleet.core.baseline.record({"agent/long-gone": object()})  # another Gym
    with pytest.raises(MembershipChanged):
        await fleet.core.checkpoint("/ck/x", SCOPE, trigger="periodic")
    fresh = make_fleet(store=fleet.store)
    try:
        await fleet.core.checkpoint("/ck/1", SCOPE)
        fresh.core.baseline.record({"gone/member": object()})
        await fresh.core.restore("/ck/1", SCOPE)
        await fresh.core.checkpoint("/ck/2", SCOPE, trigger="periodic")
    finally:
        await fresh.aclose()
