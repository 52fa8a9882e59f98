"""A seeded fault-injection simulation of the whole Gym, in one process.

Each seed draws a Gym (receipts on or off, a full or an incremental store,
step timings) and a run of it (`tests.unit.sim_gym`): episodes of random
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

CI runs `CI_SEEDS`; `pytest tests/unit/test_gym_simulation.py --seeds N`
runs seeds 0..N-1; a failing seed prints its replay command.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from ray_ckpt.control.client import data_session
from tests.unit.sequences_harness import uninterrupted
from tests.unit.sim_gym import Outcome, SimScenario, Simulation

CI_SEEDS = list(range(300))
THIS = "tests/unit/test_gym_simulation.py"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "seed" in metafunc.fixturenames:
        n = metafunc.config.getoption("--seeds", default=None)
        seeds = list(range(n)) if n else CI_SEEDS
        metafunc.parametrize("seed", seeds, ids=[f"seed{s}" for s in seeds])


def replay_command(seed: int, config: pytest.Config) -> str:
    n = config.getoption("--seeds", default=None)
    extra = f" --seeds {n}" if n and seed not in CI_SEEDS else ""
    return f".venv/bin/python -m pytest '{THIS}::test_gym_simulation[seed{seed}]'{extra}"


@functools.cache
def _expected_cache() -> dict[int, dict[str, Outcome]]:
    return {}


async def expected(scenario: SimScenario, session: object) -> dict[str, Outcome]:
    cache = _expected_cache()
    if scenario.seed not in cache:
        run = await uninterrupted(scenario.base, session)  # type: ignore[arg-type]
        out: dict[str, Outcome] = {}
        for rollout, got in run.outcomes.items():
            assert len(got) == 1, (rollout, got)
            kind, value = got[0][1]
            assert kind in ("result", "failure"), (rollout, got)
            out[rollout] = (kind, value)
        cache[scenario.seed] = out
    return cache[scenario.seed]


async def test_gym_simulation(seed: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    scenario = SimScenario.draw(seed)
    async with data_session(32, 32) as session:
        want = await expected(scenario, session)
        sim = Simulation(scenario, want, tmp_path, session)
        await sim.run()
    if sim.violations or os.environ.get("RAY_CKPT_SIM_SHOW"):
        lines = [
            f"seed {seed}: {len(sim.violations)} invariants broken",
            f"replay: {replay_command(seed, request.config)}",
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
