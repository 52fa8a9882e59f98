"""The NeMo Gym suite: real-package tests are marked `nemo_gym`.

They need the `nemo-gym` package (Python >= 3.12, not in the main venv): where
it does not import they skip with the reason.  `.ci/run`'s 3.12 stage sets
``RAY_CKPT_REQUIRE_NEMO_GYM=1``: then a missing package is an error, not a
skip, and a run in which no `nemo_gym` test passed fails the session, so the
stage can never pass by skipping everything.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE = os.environ.get("RAY_CKPT_REQUIRE_NEMO_GYM") == "1"
HAVE_NEMO_GYM = importlib.util.find_spec("nemo_gym") is not None
_passed = 0
_marked: set[str] = set()  # node IDs of the `nemo_gym` tests (keywords also hold dir names)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _marked.update(i.nodeid for i in items if i.get_closest_marker("nemo_gym") is not None)
    if HAVE_NEMO_GYM:
        return
    if REQUIRE:
        raise pytest.UsageError("RAY_CKPT_REQUIRE_NEMO_GYM=1 but nemo_gym does not import")
    skip = pytest.mark.skip(
        reason="needs the nemo-gym package (Python >= 3.12): run in .venv312, see .ci/run"
    )
    for item in items:
        if item.nodeid in _marked:
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    global _passed
    if report.when == "call" and report.passed and report.nodeid in _marked:
        _passed += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if REQUIRE and _passed == 0:
        print("\nRAY_CKPT_REQUIRE_NEMO_GYM=1: no nemo_gym test passed")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
