"""Lost work by episode length: a crash must not cost long episodes more.

Other RL stacks lose the rollouts in flight at a crash and start them over;
the long ones are the likeliest to be in flight and have the most to lose
(one lost about 30% of its prompts, biased to the long ones).  Here episodes
of 1, 2, 4 and 8 steps run together, a checkpoint lands with every one of them
mid-flight, the fleet crashes and a fresh one continues them.  Per episode we
count the model tokens generated across both fleets (every admitted call is
logged when it leaves the model) against the uninterrupted run's, and the
model turns issued again.  Each episode may lose at most the one generation
it had in flight — the same bound whatever its length — so the fraction of
an episode's work regenerated shrinks as episodes grow.  The table is printed
(CI logs) and attached to the junit report.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from coordination.demo.scenario import Rollouts
from participants.rollout import make_tasks
from ray_ckpt.control.client import data_session
from tests.e2e.conftest import Tally, assert_exactly_once, baseline, until
from tests.e2e.support_parity import (
    FAST,
    LocalGym,
    assert_idle_and_empty,
    env_keys,
    expected_work,
    publish,
    replace,
    summed,
    table,
    work,
)

LENGTHS = (1, 2, 4, 8)
PER_LENGTH = 2
CONFIG = replace(FAST, tokens_per_turn=8, turns_per_step=2, token_delay_s=0.01, step_delay_s=0.02)


def tasks() -> dict[str, dict[str, Any]]:
    return {
        f"k{k}-{j}": make_tasks(1, steps=k, seed=100 * k + j)[0]
        for k in LENGTHS
        for j in range(PER_LENGTH)
    }


async def test_a_crash_costs_every_episode_at_most_its_generation_in_flight_whatever_its_length(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    rollouts = Rollouts(tasks())
    tally = Tally(rollouts)
    steps = {r: int(t["steps"]) for r, t in rollouts.tasks.items()}
    expected = await baseline(CONFIG, rollouts.tasks)
    gym = await LocalGym.start(CONFIG)
    try:
        async with data_session(64, 64) as session:
            # Longest first, shortest last: at the checkpoint every episode is
            # mid-flight, the long ones with many steps behind them.
            for r in rollouts.tasks:
                delay = 0.09 * (max(LENGTHS) - steps[r])
                rollouts.start(session, gym.env_url, r, delay_s=delay)
            model = gym.server("model").participant

            async def every_episode_called() -> bool:
                called = {e.rollout_id for e in model.ledger}
                called |= {c.episode.rollout_id for c in model.calls.values()}
                return called == set(rollouts.tasks)

            await until(every_episode_called, "every episode to call the model", poll_s=0.005)
            await gym.prepare()
            scope = rollouts.unfinished()
            assert len(scope) == len(steps), "an episode finished before the checkpoint"
            await gym.commit(str(tmp_path / "c1"), scope)
            await gym.crash(rollouts)
            before_crash = Counter(gym.tokens.generated)
            await gym.resume()
            await gym.relaunch()
            restored = await gym.restore(str(tmp_path / "c1"), scope)
            assert env_keys(restored) == sorted(e.next().capture_key for e in scope)
            for e in scope:
                rollouts.start(session, gym.env_url, e.rollout_id, attempt=1)
            await rollouts.wait(timeout_s=60)
        assert_exactly_once(rollouts, tally, expected)
        end = await gym.stats()
        fleets = [work(s) for s in [*gym.history, end]]
        await gym.retire([e.next() for e in scope])  # the engine frees finished attempts
        await gym.forget(sorted(rollouts.tasks))
        await assert_idle_and_empty(gym)
    finally:
        await gym.close()

    log = gym.tokens
    turns_per_episode = {r: k * CONFIG.turns_per_step for r, k in steps.items()}
    base = {r: n * CONFIG.tokens_per_turn for r, n in turns_per_episode.items()}
    regen = {r: log.generated[r] - base[r] for r in steps}
    reissued = {r: log.calls[r] - turns_per_episode[r] for r in steps}
    # The log accounts for every token the two fleets generated, per episode.
    total = summed(fleets)
    assert sum(log.generated.values()) == total["tokens"]
    assert total["tools"] == expected_work(CONFIG, list(steps.values()))["tools"]

    rows = []
    for k in LENGTHS:
        group = [r for r in steps if steps[r] == k]
        planned = sum(base[r] for r in group)
        lost = sum(regen[r] for r in group)
        rows.append(
            [
                k,
                len(group),
                planned,
                sum(min(before_crash[r], base[r]) for r in group),
                lost,
                lost / planned,
                max(regen[r] for r in group),
                max(reissued[r] for r in group),
                sum(log.continued[r] for r in group),
            ]
        )
    text = table(
        "lost work by episode length: one crash with every episode mid-flight [local]",
        [
            "steps",
            "episodes",
            "tokens",
            "generated before crash",
            "tokens redone",
            "fraction redone",
            "max redone/episode",
            "max turns redone/episode",
            "prefix continued",
        ],
        rows,
    )
    publish(request, "lost_work_by_length", text)

    for r in steps:
        # No more than the generation in flight, for short and long alike.
        assert 0 <= regen[r] <= CONFIG.tokens_per_turn, (r, regen[r])
        assert 0 <= reissued[r] <= 1, (r, reissued[r])
    for k, row in zip(LENGTHS, rows, strict=True):
        # So the fraction lost is bounded by one turn of the episode's own turns.
        assert row[5] <= 1 / (k * CONFIG.turns_per_step), row
    # The long episodes had real work at risk: a restart would have lost it all.
    assert rows[-1][3] >= rows[-1][2] // 8, rows[-1]
