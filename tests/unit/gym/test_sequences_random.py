"""Seeded randomized sequences of the whole reference fleet in one process.

In the spirit of NeMo Gym's randomized sequences (reference notes §3.2), each
seed draws a small scenario (`sequences_harness.Scenario.draw`): episodes of
1-3 steps, wait or replay verifies, slow or instant tools and verifies,
deadlines that never or always expire, failing steps; then a random run of
it: starts (some late), progress, checkpoints opened at random moments and
held for random times, followed by a resume or by a crash of the fleet and a
restore into fresh in-process servers, continuations of another task and
re-runs of a superseded attempt (both refused), and stragglers retired and
re-run as the next attempt.  Invariants, against an uninterrupted run of the
same scenario:

- every rollout's outcome reaches the caller exactly once (outcomes of
  attempts the engine retired aside) and equals the uninterrupted run's
  result, or is the same typed failure;
- no outcome leaves the environment, and no model response is delivered,
  while that participant's admission is closed;
- the model's collector (`PolicyModelParticipant.collect`) gets each
  succeeded rollout's ledger exactly once from the attempts the engine
  kept (and at most once from each line of attempts it retired), and
  every ledger it gets (per attempt, at most once) equals the uninterrupted
  run's;
- every committed checkpoint verifies; the crashed ones were restored on the
  way, and the last resumed one restores into a fresh fleet;
- after the engine retires and forgets everything, every server is idle
  and holds nothing.

CI runs `CI_SEEDS`; `pytest tests/unit/gym/test_sequences_random.py --seeds N`
runs seeds 0..N-1; a failing seed prints its replay command.
"""

from __future__ import annotations

import bisect
import random
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from ray_ckpt.control.client import data_session
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage import verify_checkpoint
from tests.e2e.support_parity import assert_idle_and_empty
from tests.unit.gym.seeds import parametrize_seeds, replay_command
from tests.unit.gym.sequences_harness import (
    DETAILS,
    Driver,
    Scenario,
    SeqGym,
    Sequence,
    final_outcomes,
    restores,
    uninterrupted,
)

CI_SEEDS = list(range(200))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize_seeds(metafunc, CI_SEEDS)


async def test_random_sequence(seed: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    scenario = Scenario.draw(seed)
    DETAILS.clear()
    seeded: list[Sequence] = []
    try:
        await check_seed(scenario, tmp_path, seeded)
    except Exception as exc:  # an assertion, a timeout, a typed control error
        run = seeded[0] if seeded else None
        actions = "\n  ".join(run.log) if run is not None else "(none)"
        raise AssertionError(
            f"random sequence seed {seed} failed: {exc!r}\n"
            f"scenario: {scenario}\nactions:\n  {actions}\n"
            f"errors and failures seen:\n  {chr(10).join(DETAILS)}\n"
            f"replay: {replay_command(request, seed, CI_SEEDS)}"
        ) from exc


async def check_seed(scenario: Scenario, tmp_path: Path, seeded: list[Sequence]) -> None:
    async with data_session(64, 64) as session:
        base = await uninterrupted(scenario, session)
        assert not base.violations, base.violations
        expected = final_outcomes(base)
        succeeded = {r for r, o in expected.items() if o[0] == "result"}
        assert {e.rollout_id for e in base.collected} == succeeded, base.collected
        tasks = scenario.tasks
        gym = SeqGym(scenario)
        driver = Driver(tasks)
        try:
            await gym.relaunch()
            run = Sequence(gym, driver, random.Random(scenario.seed), tmp_path, session, expected)
            seeded.append(run)
            for _ in range(scenario.n_actions):
                await run.step()
            await run.finish()

            assert not gym.violations, gym.violations
            assert not run.refusals, run.refusals
            for rollout in tasks:
                got = [
                    o
                    for a, o in driver.outcomes.get(rollout, [])
                    if (rollout, a) not in run.retired
                ]
                assert got == [expected[rollout]], (rollout, got, expected[rollout])
            # The collector gets each rollout's trajectory once from the attempts
            # the engine kept, equal to the uninterrupted run's.  A retire of
            # attempt k discards k and every earlier attempt since the previous
            # retire (`retire_scope`): that line may have handed its trajectory
            # off once too (an attempt closed, so the model took its trajectory,
            # while a checkpoint held its outcome; a crash continued it and the
            # engine retired the continuation: seed 195), never twice.
            cuts: dict[str, list[int]] = defaultdict(list)
            for rollout, attempt in sorted(run.retired):
                cuts[rollout].append(attempt)
            handoffs: Counter[tuple[str, int]] = Counter()
            for episode, handed in gym.collected.items():
                rollout = episode.rollout_id
                assert expected[rollout][0] == "result", (episode, expected[rollout])
                want = base.collected[EpisodeId(rollout, 0)]
                assert handed == want, (episode, handed, want)
                handoffs[rollout, bisect.bisect_left(cuts[rollout], episode.attempt)] += 1
            kept = {r: n for (r, line), n in handoffs.items() if line == len(cuts[r])}
            assert kept == dict.fromkeys(succeeded, 1), (kept, sorted(succeeded))
            assert max(handoffs.values(), default=0) <= 1, handoffs
            for where in run.checkpoints:
                report = verify_checkpoint(where)
                assert report.ok, (where, report.errors)
            if run.resumed:
                # The crashed ones were restored on the way; the last resumed one
                # restores into a fresh fleet too (its next attempts, or nothing).
                where, scope = run.resumed[-1]
                keys = await restores(scenario, where, scope)
                assert keys <= {e.next().capture_key for e in scope}, (keys, scope)

            # The engine frees the final attempts and forgets every rollout.
            await gym.retire([driver.episode(r) for r in sorted(tasks)])
            await assert_idle_and_empty(gym, retired_rollouts=len(tasks))
            await gym.forget(sorted(tasks))
            await assert_idle_and_empty(gym, retired_rollouts=0)
        finally:
            await driver.abandon()
            await gym.close()
