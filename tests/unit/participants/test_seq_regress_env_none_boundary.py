"""Found by the randomized sequences (seeds 4, 27, 70, 81, 157, 159, ...).

An episode captured before its first boundary (a checkpoint closes while its
seed step, a replay step, is in flight) is exported with boundary None.  After
a restore, its correct continuation was refused by `expect_task` ("restored for
a different task"), since a None boundary is not a dict naming the task, while
`drive` itself starts a None boundary from the seed: the rollout could never
continue.
"""

from __future__ import annotations

import asyncio

import pytest

from participants.environment import expect_task, first_boundary
from ray_ckpt.errors import InvalidRequest
from ray_ckpt.identity import EpisodeId
from ray_ckpt.steps import EpisodeSteps

TASK = {"task_id": "t", "seed": 1, "steps": 1}


async def test_an_episode_captured_before_its_first_boundary_continues() -> None:
    old, episode, release = EpisodeSteps(), EpisodeId("r"), asyncio.Event()

    async def run() -> None:
        async with old.begin(episode, expect=expect_task(TASK)) as ep, ep.step("replay"):
            await release.wait()  # the seed call in flight

    task = asyncio.ensure_future(run())
    await asyncio.sleep(0.01)
    old.close_admission()  # the checkpoint closes while the seed call is in flight
    records = old.export([episode])
    assert [r.state["boundary"] for r in records] == [None]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    fresh = EpisodeSteps()
    fresh.install(records)
    # The right task continues (from the seed step, as `drive` does for None).
    ep = fresh.begin(episode.next(), expect=expect_task(TASK))
    assert ep.claim() is None


async def test_a_capture_during_the_seed_step_still_names_its_task() -> None:
    """The environment begins at `first_boundary`, so a capture taken while the
    seed step runs refuses another task and continues the right one."""
    old, episode, release = EpisodeSteps(), EpisodeId("r"), asyncio.Event()

    async def run() -> None:
        begun = old.begin(episode, boundary=first_boundary(TASK), expect=expect_task(TASK))
        async with begun as ep, ep.step("replay"):
            await release.wait()

    task = asyncio.ensure_future(run())
    await asyncio.sleep(0.01)
    old.close_admission()
    records = old.export([episode])
    assert [r.state["boundary"] for r in records] == [first_boundary(TASK)]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    fresh = EpisodeSteps()
    fresh.install(records)
    other = {**TASK, "seed": 2}
    with pytest.raises(InvalidRequest, match="different task"):
        fresh.begin(episode.next(), expect=expect_task(other))
    ep = fresh.begin(episode.next(), expect=expect_task(TASK))
    assert ep.claim() == {"next": "seed", "task_digest": first_boundary(TASK)["task_digest"]}
