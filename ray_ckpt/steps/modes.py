"""Step modes, episode states, and the verify-replayability headers.

A resources server says on its `/seed_session` reply whether its `/verify`
may run twice (`x-ng-checkpoint-verify: replay|wait`) and whether it can
capture its part of an episode at all (`x-ng-checkpoint-restart: 1` for a
restart-only server).  The caller reads both before it ever verifies, so a
non-replayable verify in flight is a `wait` step and a replayable one may be
a `replay` step.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Literal

from ray_ckpt.errors import DeadlineExceeded, InvalidRequest

VERIFY_HEADER = "x-ng-checkpoint-verify"
RESTART_HEADER = "x-ng-checkpoint-restart"


class StepMode(StrEnum):
    """What a checkpoint that closes during a step does with it."""

    # The checkpoint waits for the step; the boundary after it is exported.
    WAIT = "wait"
    # The checkpoint does not wait; the boundary before it is exported and the
    # step runs again after a crash.  Only for steps that are safe to repeat.
    REPLAY = "replay"


StepModeLike = StepMode | Literal["wait", "replay"]


def step_mode(value: StepModeLike | str) -> StepMode:
    try:
        return StepMode(value)
    except ValueError:
        raise InvalidRequest(f"step mode must be 'wait' or 'replay', got {value!r}") from None


class EpisodeState(StrEnum):
    RUNNING = "running"  # between steps: not at a boundary
    WAIT_STEP = "wait_step"
    REPLAY_STEP = "replay_step"
    PARKED = "parked"  # waiting for admission to reopen, at a boundary
    RETIRING = "retiring"  # cancelled by retire, not stopped yet
    RESTART = "restart"  # cannot be captured: never blocks, parks or exports


# States that keep a checkpoint from being ready.  A replay step is not one:
# the episode counts as parked at the boundary before it.
BLOCKING = frozenset({EpisodeState.RUNNING, EpisodeState.WAIT_STEP, EpisodeState.RETIRING})


class EpisodeTimeout(DeadlineExceeded, TimeoutError):
    """The episode's own deadline (parked time excluded) ran out."""


def seed_session_headers(
    *, verify: StepModeLike = StepMode.WAIT, restart: bool = False
) -> dict[str, str]:
    """Headers a resources server adds to its `/seed_session` reply."""
    headers = {VERIFY_HEADER: step_mode(verify).value}
    if restart:
        headers[RESTART_HEADER] = "1"
    return headers


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is not None:
        return value
    # Plain dicts are case-sensitive; HTTP header names are not.
    for key, val in headers.items():
        if key.lower() == name:
            return val
    return None


def verify_mode_from_headers(headers: Mapping[str, str]) -> StepMode:
    """The step mode for `/verify`, from the `/seed_session` reply headers.

    Missing or unrecognised means `wait`: running a verify twice that was not
    declared safe to repeat could double-count a reward or a side effect.
    """
    value = _header(headers, VERIFY_HEADER)
    if value is not None and value.strip().lower() == StepMode.REPLAY.value:
        return StepMode.REPLAY
    return StepMode.WAIT


def restart_from_headers(headers: Mapping[str, str]) -> bool:
    """True when the resources server can only restart its sessions."""
    value = _header(headers, RESTART_HEADER)
    return value is not None and value.strip() == "1"
