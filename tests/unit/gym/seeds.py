"""What the seeded tests share: CI's fixed sample of seeds, `--seeds N` for
seeds 0..N-1, and the command that replays one failing seed."""

from __future__ import annotations

import pytest


def parametrize_seeds(metafunc: pytest.Metafunc, ci_seeds: list[int]) -> None:
    """Parametrize a test's `seed` argument (call from `pytest_generate_tests`)."""
    if "seed" in metafunc.fixturenames:
        n = metafunc.config.getoption("--seeds", default=None)
        seeds = list(range(n)) if n else ci_seeds
        metafunc.parametrize("seed", seeds, ids=[f"seed{s}" for s in seeds])


def replay_command(request: pytest.FixtureRequest, seed: int, ci_seeds: list[int]) -> str:
    """The command that runs this seed again (with `--seeds` when CI's sample lacks it)."""
    n = request.config.getoption("--seeds", default=None)
    extra = f" --seeds {n}" if n and seed not in ci_seeds else ""
    return f".venv/bin/python -m pytest '{request.node.nodeid}'{extra}"
