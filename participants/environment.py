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
hooks are the `EpisodeSteps` ones, plus completion receipts when they are on
(`EnvironmentParticipant`, `ray_ckpt.steps.receipts`): each finished result
is held until acknowledged, exported with every checkpoint and installed
again by a restore; a scope naming a finished, unacknowledged episode is
refused (`FinishedInScope`), and past the configured bounds the participant
is not ready (blocker `unacknowledged-results:N`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from participants.common import digest
from ray_ckpt.errors import (
    FinishedInScope,
    InvalidCheckpointState,
    InvalidRequest,
    ResultHeld,
)
from ray_ckpt.identity import EpisodeId, is_result_key
from ray_ckpt.reports import Blocker, PrepareReport, Receipt
from ray_ckpt.steps import Episode, EpisodeSteps, restart_from_headers, verify_mode_from_headers
from ray_ckpt.steps.episode_participant import EpisodeParticipant
from ray_ckpt.steps.receipts import ResultReceipts
from ray_ckpt.storage.records.record import Record


class EnvironmentParticipant(EpisodeParticipant):
    """The `EpisodeSteps` hooks, plus the held results when receipts are on.

    `receipts` is the optional hook the engine's `ack` and `collect`
    look up: None (receipts off) keeps every hook exactly the episodes' own."""

    def __init__(self, steps: EpisodeSteps, receipts: ResultReceipts | None = None) -> None:
        super().__init__("environment", steps)
        self.receipts = receipts
        self._notify: Callable[[], None] = _nothing

    def bind(self, notify: Callable[[], None]) -> None:
        self._notify = notify
        super().bind(notify)

    def hold(self, episode: EpisodeId, result: Any) -> Receipt | None:
        """Keep a finished result until acknowledged; its receipt (None: receipts off)."""
        if self.receipts is None:
            return None
        receipt = self.receipts.hold(episode, result)
        self._notify()  # may pass a bound: readiness changed
        return receipt

    def refuse_finished(self, episode: EpisodeId) -> None:
        """Refuse (`ResultHeld`) a run of a rollout whose result is held: it
        finished already, and its result waits for `collect`, not a rerun."""
        held = None if self.receipts is None else self.receipts.held_of(episode.rollout_id)
        if held is not None:
            raise ResultHeld(
                f"rollout {episode.rollout_id} finished (attempt {held.attempt}) and its "
                "result is held for acknowledgement: collect and ack it, or retire the "
                "rollout, instead of running it again"
            )

    def ready(self) -> bool:
        return self.steps.ready() and (self.receipts is None or self.receipts.blocker() is None)

    def report(self, limit: int) -> PrepareReport:
        report = self.steps.report(limit)
        key = None if self.receipts is None else self.receipts.blocker()
        if key is None:
            return report
        assert self.receipts is not None
        blocker = Blocker(
            key=key,
            state="unacknowledged",
            detail=f"{len(self.receipts)} results, {self.receipts.bytes} bytes held: "
            f"over the bound of {self.receipts.max_results} results or "
            f"{self.receipts.max_bytes} bytes; acknowledge them",
        )
        return msgspec.structs.replace(
            report,
            ready=False,
            blockers=[blocker, *report.blockers][: max(limit, 1)],
            blocker_count=max(report.blocker_count, len(report.blockers)) + 1,
        )

    async def export(self, scope: Sequence[EpisodeId] | None) -> list[Record]:
        if self.receipts is None:
            return await super().export(scope)
        named = self.receipts.named_by(scope or ())
        if named:
            raise FinishedInScope(
                f"commit scope names finished, unacknowledged episodes {named}: "
                "collect and acknowledge their results instead of resuming them"
            )
        return [*await super().export(scope), *self.receipts.export()]

    async def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        results = [r for r in records if is_result_key(r.key)]
        if results and self.receipts is None:
            # Restored where receipts are off: the results must not vanish.
            raise InvalidCheckpointState(
                f"the checkpoint holds {len(results)} unacknowledged results; "
                "restore it with checkpoint.completion_receipts on"
            )
        staged = ResultReceipts.stage(results)  # all validated before anything installs
        installed = await super().install([r for r in records if not is_result_key(r.key)])
        if self.receipts is not None:
            self.receipts.install(staged)
        return installed

    async def retire(self, episode_ids: Sequence[EpisodeId]) -> list[str]:
        keys = await super().retire(episode_ids)
        if self.receipts is not None:
            keys += self.receipts.drop_retired(episode_ids)
            self._notify()
        return keys

    def forget(self, rollout_ids: list[str]) -> None:
        if self.receipts is not None:
            self.receipts.forget(rollout_ids)


def _nothing() -> None:
    return None


def environment_participant(
    steps: EpisodeSteps, receipts: ResultReceipts | None = None
) -> EnvironmentParticipant:
    return EnvironmentParticipant(steps, receipts)


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
