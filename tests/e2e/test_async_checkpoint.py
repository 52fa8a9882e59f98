"""An asynchronous checkpoint of the reference fleet mid-flight: the Gym and
the trainer resume before durability, rollouts run on through the write,
`durable()` returns once the Gym manifest is written, and after a crash a
fresh fleet restores it and continues every unfinished rollout to results
equal to the uninterrupted run's."""

from __future__ import annotations

import time

import pytest
import ray

from coordination.client.pending import PendingCheckpoint
from coordination.demo.scenario import crash, restore_and_continue
from ray_ckpt.control.client import data_session
from ray_ckpt.storage import verify_checkpoint
from tests.e2e.conftest import E2E, assert_exactly_once, stats_until
from tests.ray.coord_actors import start_controlled

pytestmark = [pytest.mark.ray]

N, STEPS, SEED = 3, 2, 23


async def test_async_checkpoint_resumes_first_and_restores_after_a_crash(e2e: E2E) -> None:
    config = e2e.config(token_delay_s=0.03, tokens_per_turn=8)
    expected = await e2e.baseline(config, N, STEPS, SEED)
    gym = e2e.coordinator()
    trainer = start_controlled(e2e.namespace)
    gym.register_trainer(trainer)
    fleet = await e2e.launch(config)
    await gym.adiscover()
    rollouts, tally = e2e.rollouts(N, STEPS, SEED)
    ckpt = str(e2e.tmp / "async")
    async with data_session(256, 256) as session:
        for i, r in enumerate(rollouts.tasks):
            rollouts.start(session, fleet.urls["environment"], r, delay_s=0.15 * i)
        await stats_until(
            fleet, lambda s: s["environment"]["live_episodes"] >= 2, "two rollouts live"
        )
        scope = rollouts.unfinished()
        pending = await gym.acheckpoint(ckpt, scope, durability="async")
        returned_at = time.time()
        assert isinstance(pending, PendingCheckpoint)
        assert pending.result.pending is True
        assert pending.result.continued, "some rollout had state to continue"
        done = await pending.adurable()
        durable_at = time.time()
        assert done.checkpoint_id == pending.checkpoint_id
        assert done.total_bytes > 0
        assert verify_checkpoint(ckpt).ok
        # The trainer was resumed with the Gym, before the write was durable.
        events = ray.get(trainer.log.remote())
        assert [e[0] for e in events] == ["pause", "resume"]
        assert events[1][1] <= returned_at <= durable_at
        assert pending.done()

        await crash(fleet, rollouts)
        fresh = await e2e.launch(config)
        # Rollouts that finished after the resume are not continued again.
        still = {e.rollout_id for e in rollouts.unfinished()}
        cont = await restore_and_continue(
            gym, fresh, session, ckpt, [e for e in scope if e.rollout_id in still], rollouts
        )
        assert cont.continued, "a rollout continued from the asynchronous checkpoint"
        await rollouts.wait(timeout_s=60)
    assert_exactly_once(rollouts, tally, expected)
