"""Episode steps: boundaries, wait and replay modes, parked time.

One `EpisodeSteps` per Gym server tracks its live episodes.  A request handler
opens an episode, runs each step under ``async with episode.step(mode=...)``
and records the boundary the step reaches; a checkpoint exports the last
boundary of every episode and a restore continues from it under attempt + 1.

    async def run(request):                      # aiohttp or ASGI alike
        async with steps.begin(episode_id, deadline_s=600) as ep:
            state = ep.claim() or {"next": "seed"}   # restored boundary, once
            async with ep.deadline():              # parked time excluded
                if state["next"] == "seed":
                    async with ep.step("replay", name="seed") as step:
                        ...
                        state = {"next": "verify", "verify_mode": mode}
                        step.boundary(state)
                if state["next"] == "verify":
                    async with ep.step(state["verify_mode"], name="verify") as step:
                        reward = ...
                        state = {"next": "return", "reward": reward}
                        step.boundary(state)
            return state["reward"]

Both ends of a step, and the end of the episode, are park points while a
checkpoint is closed; a replay step's boundary takes effect only after reopen.
No outcome leaves while admission is closed: a failure (the deadline running
out inside a wait step included) waits at the park point like a result.

A continuation (`begin` of a restored attempt) can be checked before anything
changes with ``begin(..., expect=check)``; a refused or failed continuation
that recorded no boundary of its own leaves the restored entry as installed.
A restored attempt continues with the deadline budget its rollout had left.
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
