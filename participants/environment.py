"""The environment participant and the episode protocol it drives.

The environment owns the episode: `/run` begins an `EpisodeSteps` episode for
the attempt and runs it step by step, recording a boundary (JSON naming the
next step) after each (reference notes §2.4, §1.14):

1. `seed` (replay): seed the resources session; the reply headers say whether
   `/verify` may be replayed and whether the resources server can only
   restart its sessions (the episode then becomes a restart);
2. `step` x K (replay): one agent activation each — the agent holds the
   mid-step state, so the environment counts as parked at the boundary
   before the step, and the re-run after a crash continues the agent's
   restored session rather than starting the step over;
3. `verify` (the mode the resources server declared): score the session;
4. `return`: the final result.

A restored episode is continued by `/run` for attempt + 1 of the same task,
which claims the boundary exactly once; a continuation whose task differs is
refused in `EpisodeSteps.begin` (`expect_task`), before anything changes, so
the restored boundary stays for the correct continuation.  The participant
hooks are the `EpisodeSteps` ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from participants.common import digest
from ray_ckpt.errors import InvalidRequest
from ray_ckpt.identity import EpisodeId
from ray_ckpt.steps import Episode, EpisodeSteps, restart_from_headers, verify_mode_from_headers
from ray_ckpt.steps.participant import EpisodeParticipant


def environment_participant(steps: EpisodeSteps) -> EpisodeParticipant:
    return EpisodeParticipant("environment", steps)


class Downstream(Protocol):
    """The calls an episode makes (the server supplies them over HTTP)."""

    async def seed(self, episode: EpisodeId, task: dict[str, Any]) -> tuple[str, dict[str, str]]:
        """Seed the resources session: (observation, reply headers)."""
        ...

    async def activate(self, episode: EpisodeId, step: int, observation: str) -> Any: ...

    async def verify(self, episode: EpisodeId, body: dict[str, Any]) -> dict[str, Any]: ...

    async def close(self, episode: EpisodeId) -> None: ...


def task_digest(task: dict[str, Any]) -> str:
    return digest(task)


def first_boundary(task: dict[str, Any]) -> dict[str, Any]:
    """The boundary an episode begins at: exported if a checkpoint closes during
    its seed step, so even that capture names its task."""
    return {"next": "seed", "task_digest": task_digest(task)}


def expect_task(task: dict[str, Any]) -> Callable[[Any], None]:
    """The `begin(expect=...)` check: a restored boundary belongs to this task."""
    d = task_digest(task)

    def check(boundary: Any) -> None:
        # A record without the first boundary (written before it existed)
        # starts over from the seed, a replay step: nothing of a task to check.
        if boundary is None:
            return
        if not isinstance(boundary, dict) or boundary.get("task_digest") != d:
            raise InvalidRequest("the episode was restored for a different task")

    return check


def final_guess(steps: list[Any]) -> int | None:
    for step in reversed(steps):
        for turn in reversed(step.get("turns", [])):
            if turn.get("tool") == "guess":
                value = turn.get("arguments", {}).get("value")
                return value if isinstance(value, int) else None
    return None


async def drive(
    ep: Episode, task: dict[str, Any], calls: Downstream, counters: Counter[str]
) -> dict[str, Any]:
    """Run (or continue) one episode to its result; boundaries after each step."""
    eid = ep.id
    d = task_digest(task)
    state: dict[str, Any] | None = ep.claim()
    if state is not None and state.get("task_digest") != d:
        raise InvalidRequest(f"episode {eid} was restored for a different task")
    state = state or {"next": "seed", "task_digest": d}
    if state["next"] == "seed":
        async with ep.step("replay", name="seed") as st:
            observation, headers = await calls.seed(eid, task)
            state = {
                "next": "step",
                "task_digest": d,
                "verify_mode": verify_mode_from_headers(headers).value,
                "restart": restart_from_headers(headers),
                "observation": observation,
                "steps": [],
            }
            st.boundary(state)
        counters["seeds"] += 1
        if state["restart"]:
            # Right after the step's exit park: admission is open here.
            ep.mark_restart()
    while state["next"] == "step":
        index = len(state["steps"])
        async with ep.step("replay", name=f"agent-{index}") as st:
            observation = f"step {index + 1} of {task['steps']}. {state['observation']}"
            result = await calls.activate(eid, index, observation)
            steps = [*state["steps"], result]
            state = {**state, "steps": steps}
            state["next"] = "step" if len(steps) < task["steps"] else "verify"
            st.boundary(state)
        counters["agent_steps"] += 1
    if state["next"] == "verify":
        async with ep.step(state["verify_mode"], name="verify") as st:
            body = {"seed": task["seed"], "final": final_guess(state["steps"])}
            verdict = await calls.verify(eid, body)
            result = {
                "task_id": task["task_id"],
                "steps": state["steps"],
                "reward": verdict["reward"],
                "verification": verdict,
            }
            state = {"next": "return", "task_digest": d, "result": result}
            st.boundary(state)
        counters["verifications"] += 1
    # Closing is idempotent, so it is a replay step: a replacement that begins
    # at its restored `return` boundary while a checkpoint is open parks here
    # instead of running (and making the environment unready) before resume.
    async with ep.step("replay", name="close"):
        await calls.close(eid)
    return dict(state["result"])
