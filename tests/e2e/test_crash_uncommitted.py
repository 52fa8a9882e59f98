"""A crash before a checkpoint was whole: mid-prepare, and with a torn commit.

Neither leaves anything restorable from that checkpoint: a restore of it is
refused as a whole and installs nothing anywhere, while the previous
checkpoint restores into a fresh fleet and every rollout finishes exactly once
with the uninterrupted run's result.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from coordination.client.handle import CoordinatorHandle
from coordination.demo.scenario import Rollouts, crash, fleet_stats, restore_and_continue
from participants.fleet import Fleet
from ray_ckpt.control.client import data_session
from ray_ckpt.errors import CoordinationFailed
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage import verify_checkpoint
from tests.e2e.conftest import (
    E2E,
    assert_clean,
    assert_exactly_once,
    held,
    host_phases,
    stats_until,
    until,
)

pytestmark = [pytest.mark.ray]

N, STEPS, SEED = 3, 2, 33


def generating(stats: dict[str, dict[str, Any]]) -> bool:
    return bool(stats["model"]["generating"])


async def checkpoint(gym: CoordinatorHandle, rollouts: Rollouts, ckpt: str) -> list[EpisodeId]:
    """A whole checkpoint of the unfinished rollouts (scope taken once prepared)."""
    await gym.aprepare()
    scope = rollouts.unfinished()
    await gym.acommit(ckpt, scope)
    assert not (await gym.aresume()).failures
    assert verify_checkpoint(ckpt).ok
    return scope


async def assert_untouched(gym: CoordinatorHandle, fleet: Fleet) -> None:
    """A refused restore left every host idle, holding nothing, nothing open."""
    assert (await gym.astatus()).open_checkpoint is None
    assert set((await host_phases(fleet)).values()) == {"idle"}
    stats = await fleet_stats(fleet)
    assert held(stats) == dict.fromkeys(held(stats), 0)


async def test_crash_mid_prepare_leaves_nothing_and_the_previous_checkpoint_restores(
    e2e: E2E,
) -> None:
    # A long wait-mode verify keeps the environment preparing (its blocker).
    config = e2e.config(verify_delay_s=1.5)
    expected = await e2e.baseline(config, N, STEPS, SEED)
    gym = e2e.coordinator()
    fleet = await e2e.launch(config)
    rollouts, tally = e2e.rollouts(N, STEPS, SEED)
    c1, c2 = str(e2e.tmp / "c1"), str(e2e.tmp / "c2")
    async with data_session(256, 256) as session:
        for i, r in enumerate(rollouts.tasks):
            rollouts.start(session, fleet.urls["environment"], r, delay_s=0.25 * i)
        await stats_until(fleet, generating, "a generation in flight")
        await checkpoint(gym, rollouts, c1)

        await stats_until(
            fleet,
            lambda s: s["resources"]["inflight_by_route"].get("verify", 0) >= 1,
            "a verify in flight",
        )
        prepare = asyncio.ensure_future(gym.aprepare())
        env = fleet.hosts["environment"]

        async def blocked() -> dict[str, Any] | None:
            status: dict[str, Any] = await env.status.remote()
            if status["phase"] == "preparing" and status["report"]["blocker_count"] >= 1:
                return status
            return None

        status = await until(blocked, "the environment preparing behind a blocker", timeout_s=5)
        assert status is not None
        assert not prepare.done()
        await crash(fleet, rollouts)
        with pytest.raises(CoordinationFailed) as info:
            await prepare
        assert info.value.failures[fleet.names["environment"]]["code"] == "participant_unavailable"
        blockers = status["report"]["blocker_details"]
        assert all(b["mode"] == "wait" for b in blockers), blockers
        assert {b["key"] for b in blockers} <= {e.capture_key for e in rollouts.unfinished()}
        assert not written(c2), "a checkpoint that never committed wrote nothing"

        fresh = await e2e.launch(config)
        scope = rollouts.unfinished()
        with pytest.raises(CoordinationFailed) as info:
            await gym.arestore(c2, scope)
        assert set(info.value.failures) == {"gym-manifest"}
        await assert_untouched(gym, fresh)

        cont = await restore_and_continue(gym, fresh, session, c1, scope, rollouts)
        assert cont.continued
        await rollouts.wait(timeout_s=60)
    assert_exactly_once(rollouts, tally, expected)
    await assert_clean(fresh)


def written(path: str) -> bool:
    return Path(path).exists()


def tear(ckpt: str, kind: str) -> Path:
    """Cut one participant's records file in half (a commit torn by a crash)."""
    (pdir,) = (Path(ckpt) / "gym" / kind).iterdir()
    (records,) = pdir.glob("records-*")
    size = records.stat().st_size
    assert size > 16
    os.truncate(records, size // 2)
    return records


@pytest.mark.slow
async def test_a_torn_commit_is_refused_as_a_whole_and_the_previous_checkpoint_restores(
    e2e: E2E,
) -> None:
    config = e2e.config()
    expected = await e2e.baseline(config, N, STEPS, SEED)
    gym = e2e.coordinator()
    fleet = await e2e.launch(config)
    rollouts, tally = e2e.rollouts(N, STEPS, SEED)
    c1, c2 = str(e2e.tmp / "c1"), str(e2e.tmp / "c2")
    async with data_session(256, 256) as session:
        for i, r in enumerate(rollouts.tasks):
            rollouts.start(session, fleet.urls["environment"], r, delay_s=0.15 * i)
        first = await stats_until(fleet, generating, "a generation in flight")
        await checkpoint(gym, rollouts, c1)
        tokens = first["model"]["tokens_generated"]
        await stats_until(
            fleet,
            lambda s: generating(s) and s["model"]["tokens_generated"] >= tokens + 12,
            "more tokens generated after the first checkpoint",
        )
        await gym.aprepare()
        await gym.acommit(c2, rollouts.unfinished())
        assert verify_checkpoint(c2).ok
        torn = tear(c2, "model")
        report = verify_checkpoint(c2)
        assert not report.ok
        assert [c.kind for c in report.participants if not c.ok] == ["model"]

        await crash(fleet, rollouts)
        await gym.aresume()

        scope = rollouts.unfinished()
        second = await e2e.launch(config)
        with pytest.raises(CoordinationFailed) as info:
            await gym.arestore(c2, scope)
        assert set(info.value.failures) == {fleet.names["model"]}, info.value.failures
        assert info.value.failures[fleet.names["model"]]["code"] == ("invalid_checkpoint_state")
        # All or nothing: what the other participants installed was undone.
        await assert_untouched(gym, second)
        # ...by retiring the attempts the restore would have continued, everywhere.
        env_status = await second.hosts["environment"].status.remote()
        assert env_status["retired_rollouts"] == len(scope)
        assert written(str(torn))

        second.kill()  # a restore needs fresh processes: start another fleet
        third = await e2e.launch(config)
        cont = await restore_and_continue(gym, third, session, c1, scope, rollouts)
        assert cont.continued
        await rollouts.wait(timeout_s=60)
    assert_exactly_once(rollouts, tally, expected)
    await assert_clean(third)
