"""The drain watcher's decisions against a fake node-state source and
recording actions (the real source is Ray's private draining-node call)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from coordination.triggers.drain import (
    NO_DEADLINE_BUDGET_S,
    DrainWatcher,
    plan_drain,
)
from coordination.triggers.signals import Budget
from ray_ckpt.errors import CoordinationFailed

NOW = 1_800_000_000.0
PLACEMENT = {"environment": "nA", "agent": "nA", "model": "nB", "resources": "nB"}


def test_only_a_draining_node_with_gym_hosts_makes_a_plan() -> None:
    assert plan_drain({"nX": NOW + 30}, PLACEMENT, set(), NOW) is None
    plan = plan_drain({"nA": NOW + 30, "nX": NOW + 5}, PLACEMENT, set(), NOW, margin_s=1)
    assert plan is not None
    assert plan.nodes == ["nA"]
    assert plan.hosts == ["agent", "environment"]
    assert plan.budget_s == pytest.approx(29.0)
    assert not plan.too_short
    assert plan_drain({"nA": NOW + 30}, PLACEMENT, {"nA"}, NOW) is None  # handled


def test_nodes_draining_together_make_one_plan_inside_the_earliest_deadline() -> None:
    plan = plan_drain({"nA": NOW + 30, "nB": NOW + 10}, PLACEMENT, set(), NOW, margin_s=1)
    assert plan is not None
    assert plan.nodes == ["nA", "nB"]
    assert plan.hosts == sorted(PLACEMENT)
    assert plan.deadline == NOW + 10
    assert plan.budget_s == pytest.approx(9.0)


def test_a_deadline_too_short_or_none() -> None:
    short = plan_drain({"nA": NOW + 2.5}, PLACEMENT, set(), NOW, margin_s=1, min_budget_s=2)
    assert short is not None
    assert short.too_short
    none = plan_drain({"nA": None}, PLACEMENT, set(), NOW)
    assert none is not None
    assert none.budget_s == NO_DEADLINE_BUDGET_S
    assert not none.too_short


class Source:
    def __init__(self, draining: dict[str, float | None]) -> None:
        self.now = draining
        self.fail = False

    def draining(self) -> dict[str, float | None]:
        if self.fail:
            raise RuntimeError("GCS unreachable")
        return dict(self.now)


class Actions:
    def __init__(self, *, fail_checkpoint: bool = False) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail_checkpoint = fail_checkpoint

    async def placement(self) -> dict[str, str]:
        return dict(PLACEMENT)

    async def checkpoint(self, location: str, budget: Budget) -> Any:
        self.calls.append(("checkpoint", (location, budget)))
        if self.fail_checkpoint:
            raise CoordinationFailed("commit failed at model/ref-model")

        class Result:
            checkpoint_id = "ckpt-1"

        return Result()

    async def relaunch(self, hosts: list[str], avoid: list[str]) -> dict[str, str]:
        self.calls.append(("relaunch", (hosts, avoid)))
        return dict.fromkeys(hosts, "nC")

    async def restore(self, location: str) -> Any:
        self.calls.append(("restore", location))


def watcher(source: Source, actions: Actions) -> DrainWatcher:
    return DrainWatcher(source, actions, "/ckpt/root", wall=lambda: NOW, margin_s=1)


async def test_a_drain_checkpoints_inside_its_deadline_moves_the_hosts_and_restores() -> None:
    actions = Actions()
    w = watcher(Source({"nA": NOW + 21}), actions)
    out = await w.poll_once()
    assert out is not None
    assert out.ok
    assert [c[0] for c in actions.calls] == ["checkpoint", "relaunch", "restore"]
    where, budget = actions.calls[0][1]
    assert where.startswith("/ckpt/root/ckpt-")
    assert where.endswith("-drain")
    assert budget.wait_s == pytest.approx(20.0)
    assert budget.prepare_s + budget.commit_s < 20.0
    assert actions.calls[1][1] == (["agent", "environment"], ["nA"])
    assert actions.calls[2][1] == where
    assert out.moved == {"agent": "nC", "environment": "nC"}
    assert out.checkpoint_id == "ckpt-1"
    # Still listed as draining until it is gone: not handled twice.
    assert await w.poll_once() is None
    assert len(actions.calls) == 3


async def test_a_deadline_too_short_is_reported_and_nothing_is_attempted() -> None:
    actions = Actions()
    out = await watcher(Source({"nA": NOW + 1.5}), actions).poll_once()
    assert out is not None
    assert not out.ok
    assert out.error is not None
    assert out.error["code"] == "deadline_exceeded"
    assert out.location is None
    assert actions.calls == []


async def test_a_failed_checkpoint_moves_nothing() -> None:
    actions = Actions(fail_checkpoint=True)
    out = await watcher(Source({"nB": NOW + 30}), actions).poll_once()
    assert out is not None
    assert not out.ok
    assert out.error is not None
    assert out.error["code"] == "coordination_failed"
    assert out.checkpoint_id is None
    assert [c[0] for c in actions.calls] == ["checkpoint"]


async def test_the_loop_outlives_a_failing_poll() -> None:
    source, actions = Source({"nA": NOW + 30}), Actions()
    source.fail = True
    stop = asyncio.Event()
    polls = 0

    async def sleep(_s: float) -> None:
        nonlocal polls
        polls += 1
        source.fail = False  # the next poll reaches the GCS
        if polls == 2:
            stop.set()

    w = DrainWatcher(source, actions, "/r", wall=lambda: NOW, sleep=sleep)
    await w.run(stop)
    assert polls == 2
    assert [o.ok for o in w.outcomes] == [True]
