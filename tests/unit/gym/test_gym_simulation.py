"""A seeded fault-injection simulation of the whole Gym, in one process.

Each seed draws a Gym (receipts on or off, a full or an incremental store,
step timings) and a run of it (`tests.unit.gym.sim_gym`): episodes of random
steps; checkpoints from every trigger (manual whole sync and async, manual
split prepare/commit/resume, periodic with retention, signal, drain with a
relaunch that may fail), back to back and overlapping an asynchronous one
still publishing; restores into fresh fleets; retires, forgets, acks and
collects; gc at random moments.  Faults, each drawn per seed: a
participant's write fails or is slow, the Gym manifest or `LATEST` write is
delayed, a reply is lost after the participant acted, a member dies (idle,
prepared, committed, writing in the background, restored), a relaunch
fails, a prepare deadline passes, a failed checkpoint is retried into the
same directory, a restore is aimed at the live fleet.

Invariants after every action: no checkpoint is left open and no
participant closed; `LATEST` names the newest complete checkpoint; every
complete checkpoint is of the whole Gym and (after gc and at the end)
verifies; a restore of the live fleet is refused; a retry into the same
directory works; every typed refusal a trainer meets on a whole Gym is one
it caused (a retire) or a restored attempt whose state a participant lost.
At the end: every rollout has exactly one result, equal to the
uninterrupted run's; no restored attempt began from scratch; the latest
checkpoint restores into a fresh fleet exactly what it captured.

CI runs `CI_SEEDS`; `pytest tests/unit/gym/test_gym_simulation.py --seeds N`
runs seeds 0..N-1; a failing seed prints its replay command, the Gym it
drew, its actions and the refusals its trainer met (`RAY_CKPT_SIM_SHOW=1`
prints them for a passing seed too).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ray_ckpt.control.client import data_session
from tests.unit.gym.seeds import parametrize_seeds, replay_command
from tests.unit.gym.sequences_harness import final_outcomes, uninterrupted
from tests.unit.gym.sim_gym import SimScenario, Simulation

CI_SEEDS = list(range(300))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    parametrize_seeds(metafunc, CI_SEEDS)


async def test_gym_simulation(seed: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    scenario = SimScenario.draw(seed)
    async with data_session(32, 32) as session:
        want = final_outcomes(await uninterrupted(scenario.base, session))
        sim = Simulation(scenario, want, tmp_path, session)
        await sim.run()
    if sim.violations or os.environ.get("RAY_CKPT_SIM_SHOW"):
        lines = [
            f"seed {seed}: {len(sim.violations)} invariants broken",
            f"replay: {replay_command(request, seed, CI_SEEDS)}",
            f"gym: receipts={scenario.config.completion_receipts} "
            f"full_every={scenario.full_every} faults={sorted(scenario.faults)}",
            "broken:",
            *(f"  {v}" for v in dict.fromkeys(sim.violations)),
            "actions:",
            *(f"  {a}" for a in sim.log),
            "refusals:",
            *(f"  {r}" for r in sim.trainer.refusals),
        ]
        if not sim.violations:
            print("\n".join(lines))
            return
        pytest.fail("\n".join(lines), pytrace=False)
