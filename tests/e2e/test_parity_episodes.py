"""NeMo-Gym-parity cases about one episode's fate (reference notes §3.1), in process.

The fleet runs in this event loop behind the real coordination logic
(`CoordinatorCore` over the servers' own engines), with real files and
loopback HTTP: none of these cases needs a second process to be meaningful.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from coordination.demo.scenario import Rollouts
from participants.rollout import run_episode
from ray_ckpt.control.client import data_session
from ray_ckpt.errors import CoordinationFailed, StaleAttempt
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage import read_participant
from tests.e2e.conftest import Tally, assert_exactly_once, baseline
from tests.e2e.support_parity import (
    FAST,
    LocalGym,
    assert_idle_and_empty,
    crash_restore,
    env_keys,
    generating,
    replace,
    stats_until,
)


@pytest.fixture
async def gyms() -> AsyncIterator[list[LocalGym]]:
    started: list[LocalGym] = []
    yield started
    for gym in started:
        await gym.close()


def records(gym: LocalGym, where: Path, kind: str) -> dict[str, Any]:
    name = gym.config.server_name(kind)
    _, recs = read_participant(where, kind=kind, instance=name, checkpoint_id=None)
    return {r.key: r.state for r in recs}


@pytest.mark.parametrize("crash", [True, False], ids=["crash", "no-crash"])
async def test_an_episode_finishing_during_prepare_is_neither_lost_nor_redone(
    gyms: list[LocalGym], tmp_path: Path, crash: bool
) -> None:
    config = replace(FAST, verify_delay_s=0.3, turns_per_step=1, tokens_per_turn=4)
    rollouts = Rollouts.make(1, steps=1, seed=23)
    tally = Tally(rollouts)
    expected = await baseline(config, rollouts.tasks)
    gym = await LocalGym.start(config)
    gyms.append(gym)
    r0 = EpisodeId("r0")
    async with data_session(16, 16) as session:
        rollouts.start(session, gym.env_url, "r0")
        await stats_until(
            gym, lambda s: s["resources"]["inflight_by_route"].get("verify"), "verify in flight"
        )
        await gym.prepare()
        # The verify was a wait step: prepare waited and it finished inside it.
        prepared = await gym.stats()
        assert prepared["resources"]["verifications"] == 1
        assert prepared["environment"]["live_episodes"] == 1
        await gym.commit(str(tmp_path / "c1"), [r0])
        state = records(gym, tmp_path / "c1", "environment")["r0"]
        assert state["boundary"]["next"] == "return"
        await asyncio.sleep(0.2)
        assert not rollouts.results, "a result was delivered while the checkpoint was open"

        if crash:
            restored = await crash_restore(gym, rollouts, str(tmp_path / "c1"), [r0])
            assert env_keys(restored) == ["r0-a1"]
            rollouts.start(session, gym.env_url, "r0", attempt=1)
        else:
            await gym.resume()
        await rollouts.wait(timeout_s=20)
    assert_exactly_once(rollouts, tally, expected)
    assert tally.attempt == {"r0": 1 if crash else 0}
    end = await gym.stats()
    if crash:
        # The replacement only returned the result: nothing ran again.
        assert end["resources"]["verifications"] == 0
        assert end["resources"]["calls"] == {"close_session": 1}
        assert end["agent"]["activations"] == 0
        assert end["model"]["tokens_generated"] == 0
    else:
        assert end["resources"]["verifications"] == 1
        assert end["environment"]["verifications"] == 1


async def test_a_retired_episode_stops_everywhere_and_leaves_nothing_behind(
    gyms: list[LocalGym],
) -> None:
    rollouts = Rollouts.make(1, steps=3, seed=24)
    tally = Tally(rollouts)
    expected = await baseline(FAST, rollouts.tasks)
    gym = await LocalGym.start(FAST)
    gyms.append(gym)
    task = rollouts.tasks["r0"]
    async with data_session(16, 16) as session:
        rollouts.start(session, gym.env_url, "r0")
        await stats_until(
            gym,
            lambda s: s["agent"]["tool_calls"] >= 1 and generating(s, below=FAST.tokens_per_turn),
            "a generation in flight after a tool move",
        )
        driver = rollouts.running["r0"]
        await gym.retire([EpisodeId("r0")])
        # Retire replies only once the attempt stopped: its /run has ended.
        assert driver.done()
        assert "r0" in rollouts.failures
        assert not rollouts.results
        before = await gym.stats()
        await asyncio.sleep(0.3)
        after = await gym.stats()
        for kind in before:
            assert after[kind]["calls"] == before[kind]["calls"], kind
        assert after["model"]["tokens_generated"] == before["model"]["tokens_generated"]
        await assert_idle_and_empty(gym, retired_rollouts=1)

        # A late duplicate of the retired attempt is refused everywhere.
        with pytest.raises(StaleAttempt):
            await run_episode(session, gym.env_url, EpisodeId("r0"), task)
        async with session.post(
            gym.urls["model"] + "/ng-rollout/r0/v1/responses",
            data=orjson.dumps({"input": [{"role": "user", "content": "late"}]}),
        ) as resp:
            assert resp.status == 409
            assert (await resp.json())["error"]["code"] == "stale_attempt"
        await assert_idle_and_empty(gym, retired_rollouts=1)

        await gym.forget(["r0"])
        await assert_idle_and_empty(gym, retired_rollouts=0)
        # The engine dispatches the rollout again as the next attempt.
        rollouts.start(session, gym.env_url, "r0", attempt=1)
        await rollouts.wait(timeout_s=20)
    assert_exactly_once(rollouts, tally, expected)
    # A finished attempt's ledger is freed the same way, then forgotten.
    await gym.retire([EpisodeId("r0", 1)])
    await gym.forget(["r0"])
    await assert_idle_and_empty(gym, retired_rollouts=0)


@pytest.mark.parametrize("crash", [True, False], ids=["crash", "no-crash"])
async def test_a_restart_only_episode_never_holds_up_a_checkpoint(
    gyms: list[LocalGym], tmp_path: Path, crash: bool
) -> None:
    config = replace(FAST, resources_mode="restart_only")
    rollouts = Rollouts.make(3, steps=2, seed=25)
    tally = Tally(rollouts)
    expected = await baseline(config, rollouts.tasks)
    gym = await LocalGym.start(config)
    gyms.append(gym)
    async with data_session(16, 16) as session:
        for i, rollout in enumerate(rollouts.tasks):
            rollouts.start(session, gym.env_url, rollout, delay_s=0.03 * i)
        await stats_until(
            gym,
            lambda s: s["resources"]["sessions"] == 3 and s["agent"]["tool_calls"] >= 1,
            "every episode seeded",
        )
        prepared = await gym.prepare()
        restarts = sorted({k for keys in prepared.restarts.values() for k in keys})
        assert restarts == ["r0", "r1", "r2"]
        # A scope naming a restart fails closed; the checkpoint is aborted.
        with pytest.raises(CoordinationFailed) as failed:
            await gym.commit(str(tmp_path / "bad"), [EpisodeId("r0")])
        codes = {f["code"] for f in failed.value.failures.values()}
        assert codes == {"restart_in_scope"}
        assert (await gym.status()).open_checkpoint is None

        await gym.prepare()
        committed = await gym.commit(str(tmp_path / "c1"), [])
        assert env_keys(committed) == []
        assert records(gym, tmp_path / "c1", "environment") == {}
        assert records(gym, tmp_path / "c1", "resources") == {}
        if crash:
            restored = await crash_restore(gym, rollouts, str(tmp_path / "c1"), [])
            assert env_keys(restored) == []
            for rollout in rollouts.tasks:
                rollouts.start(session, gym.env_url, rollout, attempt=1)
        else:
            await gym.resume()
        await rollouts.wait(timeout_s=30)
    assert_exactly_once(rollouts, tally, expected)
    assert tally.attempt == dict.fromkeys(expected, 1 if crash else 0)
    if crash:
        # Nothing survived: every episode started over from its task.
        assert (await gym.stats())["resources"]["calls"]["seed_session"] == 3


async def test_a_replacement_at_its_return_boundary_begins_during_a_checkpoint_without_blocking(
    gyms: list[LocalGym], tmp_path: Path
) -> None:
    """Found by the sequence test: the replacement of an episode restored at
    `return` may begin while the next checkpoint is prepared; it must park, not
    close its sessions then (which made the environment unready and failed the
    commit with `invalid_phase`)."""
    config = replace(FAST, verify_delay_s=0.2, turns_per_step=1, tokens_per_turn=4)
    rollouts = Rollouts.make(1, steps=1, seed=26)
    tally = Tally(rollouts)
    expected = await baseline(config, rollouts.tasks)
    gym = await LocalGym.start(config)
    gyms.append(gym)
    r0 = EpisodeId("r0")
    async with data_session(16, 16) as session:
        rollouts.start(session, gym.env_url, "r0")
        await stats_until(
            gym, lambda s: s["resources"]["inflight_by_route"].get("verify"), "verify in flight"
        )
        await gym.prepare()
        await gym.commit(str(tmp_path / "c1"), [r0])
        await crash_restore(gym, rollouts, str(tmp_path / "c1"), [r0])
        await gym.prepare()
        rollouts.start(session, gym.env_url, "r0", attempt=1)
        steps = gym.server("environment").steps
        async with asyncio.timeout(5):
            while not steps.live_executions():  # noqa: ASYNC110 - the very first moment it is live
                await asyncio.sleep(0)
        assert steps.ready(), steps.report()
        committed = await gym.commit(str(tmp_path / "c2"), [r0.next()])
        assert env_keys(committed) == ["r0-a1"]
        assert records(gym, tmp_path / "c2", "environment")["r0-a1"]["boundary"]["next"] == "return"
        await gym.resume()
        await rollouts.wait(timeout_s=20)
    assert_exactly_once(rollouts, tally, expected)
    assert tally.attempt == {"r0": 1}
