"""Episode steps: boundaries, wait and replay modes, parked time.

One `EpisodeSteps` per Gym server tracks its live episodes.  A request handler
opens an episode, runs each step under ``async with episode.step(mode=...)``
and records the boundary the step reaches; a checkpoint exports the last
boundary of every episode and a restore continues from it under attempt + 1.
"""

from ray_ckpt.steps.episode import DeadlineScope, Episode, Step
from ray_ckpt.steps.modes import (
    BLOCKING,
    RESTART_HEADER,
    VERIFY_HEADER,
    EpisodeState,
    EpisodeTimeout,
    StepMode,
    StepModeLike,
    restart_from_headers,
    seed_session_headers,
    step_mode,
    verify_mode_from_headers,
)
from ray_ckpt.steps.table import EpisodeSteps

__all__ = [
    "BLOCKING",
    "RESTART_HEADER",
    "VERIFY_HEADER",
    "DeadlineScope",
    "Episode",
    "EpisodeState",
    "EpisodeSteps",
    "EpisodeTimeout",
    "Step",
    "StepMode",
    "StepModeLike",
    "restart_from_headers",
    "seed_session_headers",
    "step_mode",
    "verify_mode_from_headers",
]
