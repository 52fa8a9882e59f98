"""`handle.checkpoint_on_signal` on the shared cluster, in this process's loop:
a real SIGUSR1 checkpoints the fleet mid-rollout under the root (LATEST names
it) and every rollout goes on to the end; `stop_checkpoint_on_signal` puts the
previous handler back."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from ray_ckpt.control.client import data_session
from tests.e2e.conftest import E2E

pytestmark = [pytest.mark.ray]


async def test_sigusr1_through_the_handle_checkpoints_and_goes_on(e2e: E2E) -> None:
    n, steps, seed = 3, 3, 5
    config = e2e.config()
    gym = e2e.coordinator()
    fleet = await e2e.launch(config)
    await gym.adiscover()
    rollouts, _ = e2e.rollouts(n, steps, seed)
    root = e2e.tmp / "root"
    before = signal.getsignal(signal.SIGUSR1)
    async with data_session(256, 256) as session:
        for i, r in enumerate(rollouts.tasks):
            rollouts.start(session, fleet.urls["environment"], r, delay_s=0.05 * i)
        await asyncio.sleep(0.5)  # every rollout is mid-flight
        sc = gym.checkpoint_on_signal(str(root), scope=rollouts.unfinished, grace_s=20)
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            async with asyncio.timeout(20):
                while not sc.outcomes:  # noqa: ASYNC110 - set by the signal's checkpoint
                    await asyncio.sleep(0.02)
        finally:
            gym.stop_checkpoint_on_signal()
        await rollouts.wait(timeout_s=60)
    assert signal.getsignal(signal.SIGUSR1) is before
    (out,) = sc.outcomes
    assert out.ok, out.error
    assert out.trigger == "SIGUSR1"
    assert out.episodes > 0
    assert json.loads((root / "LATEST").read_text())["checkpoint_id"] == out.checkpoint_id
    assert sorted(rollouts.results) == sorted(rollouts.tasks)  # all went on to the end
    status = await gym.astatus()
    assert status.open_checkpoint is None
    # The timeline names what started it.
    trace = await gym.atimeline(str(out.checkpoint_id))
    assert (trace["otherData"]["trigger"], trace["otherData"]["outcome"]) == ("signal", "ok")
