"""Completion receipts through the coordinator core: collect from every
environment participant, all-or-nothing ack across them, and a checkpoint
whose scope names a finished result refused whole (nothing published)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from coordination.engine import receipts
from coordination.engine.order import Member
from coordination.reach.hosts import FakeHost
from participants.environment import EnvironmentParticipant
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import CoordinationFailed, InvalidRequest, UnknownReceipt
from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import Receipt
from ray_ckpt.steps import EpisodeSteps
from ray_ckpt.steps.receipts import ResultReceipts
from tests.unit.coordination.coord_fleet import SETTINGS, Fleet, make_fleet

ENVS = ("environment/e0", "environment/e1")


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[Fleet, dict[str, EnvironmentParticipant]]]:
    f = make_fleet(("model/policy", "agent/agent", "resources/res"))
    envs: dict[str, EnvironmentParticipant] = {}
    for key in ENVS:
        m = Member.parse(key)
        part = EnvironmentParticipant(
            EpisodeSteps(), ResultReceipts(max_results=100, max_bytes=1 << 20)
        )
        ctl = ParticipantEngine(part, instance=m.name, settings=SETTINGS, store=f.store)
        f.hosts[key], f.ctrls[key] = FakeHost(m, ctl, log=f.log), ctl
        f.core.register(f.hosts[key])
        envs[key] = part
    yield f, envs
    await f.aclose()


async def finish(p: EnvironmentParticipant, rollout: str, reward: int) -> Receipt:
    eid = EpisodeId(rollout)
    async with p.steps.begin(eid) as ep, ep.step("replay", name="work") as step:
        step.boundary({"next": "return"})
    receipt = p.hold(eid, {"reward": reward})
    assert receipt is not None
    return receipt


async def test_collect_gathers_every_environment_and_ack_frees_each_where_held(
    fleet: tuple[Fleet, dict[str, EnvironmentParticipant]],
) -> None:
    f, envs = fleet
    a = await finish(envs["environment/e0"], "r1", 1)
    b = await finish(envs["environment/e1"], "r2", 2)
    got = await receipts.collect(f.core)
    assert [(r.participant, r.receipt, r.result) for r in got.results] == [
        ("environment/e0", a, {"reward": 1}),
        ("environment/e1", b, {"reward": 2}),
    ]
    # Only environment participants are asked.
    assert sorted(k for k, h in f.hosts.items() if ("collect", {}) in h.calls) == list(ENVS)

    rows = {r.participant: r for r in (await f.core.status()).participants}
    assert rows["environment/e0"].unacknowledged_results == 1
    assert (rows["environment/e1"].unacknowledged_bytes or 0) > 0
    assert rows["model/policy"].unacknowledged_results == 0

    done = await receipts.ack(f.core, [a, b])
    assert done.acknowledged == {"environment/e0": [a], "environment/e1": [b]}
    assert done.already == []
    assert (await receipts.collect(f.core)).results == []
    again = await receipts.ack(f.core, [a, b])
    assert (again.acknowledged, again.already) == ({}, [a, b])


async def test_a_receipt_no_participant_knows_refuses_the_whole_ack(
    fleet: tuple[Fleet, dict[str, EnvironmentParticipant]],
) -> None:
    f, envs = fleet
    a = await finish(envs["environment/e0"], "r1", 1)
    stray = Receipt(rollout_id="nobody", digest="e" * 64)
    with pytest.raises(UnknownReceipt) as err:
        await receipts.ack(f.core, [a, stray])
    assert "nobody" in err.value.detail
    assert [r.receipt for r in (await receipts.collect(f.core)).results] == [a]
    with pytest.raises(InvalidRequest):
        receipts.receipt_list([{"rollout_id": "r1"}])
    assert receipts.receipt_list([as_dict(a), a]) == [a]


def as_dict(r: Receipt) -> dict[str, object]:
    return {"rollout_id": r.rollout_id, "attempt": r.attempt, "digest": r.digest}


async def test_a_dead_environment_fails_collect_by_name(
    fleet: tuple[Fleet, dict[str, EnvironmentParticipant]],
) -> None:
    f, _ = fleet
    f.hosts["environment/e1"].dead = True
    with pytest.raises(CoordinationFailed) as err:
        await receipts.collect(f.core)
    assert set(err.value.failures) == {"environment/e1"}


async def test_a_checkpoint_whose_scope_names_a_finished_result_publishes_nothing(
    fleet: tuple[Fleet, dict[str, EnvironmentParticipant]],
) -> None:
    f, envs = fleet
    await finish(envs["environment/e0"], "r1", 1)
    with pytest.raises(CoordinationFailed) as err:
        await f.core.checkpoint("/ckpt/c1", [EpisodeId("r1"), EpisodeId("r9")])
    assert err.value.failures["environment/e0"]["code"] == "finished_in_scope"
    assert f.manifests == []
    assert set(f.phases().values()) == {"idle"}
    # Without it in the scope the checkpoint carries the held result.
    done = await f.core.checkpoint("/ckpt/c2", [EpisodeId("r9")])
    assert done.episode_ids["environment/e0"] == []
    assert [d for d, _, _ in f.manifests] == ["/ckpt/c2"]
    _, records = f.store.data[("/ckpt/c2", "environment", "e0")]
    assert [r.key for r in records] == ["result:r1"]
