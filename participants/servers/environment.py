"""The reference environment server: `/run` drives one episode over HTTP.

`POST /run` `{"episode_id": {"rollout_id", "attempt"}, "task": {"task_id",
"seed", "steps", ...}}` answers `{"episode_id", "task_id", "result"}` or
`{"episode_id", "task_id", "failure": {"code", "detail"}}` (exactly one).  A
run refused before it began (`admission_closed` while a checkpoint is open,
`stale_attempt`, a malformed body) is an error reply instead, so the caller
can retry or give up.  For `r-aN` the run continues the restored boundary.
`GET /stats` reports calls, seeds, agent steps and verifications run, and
live and restored episodes.

With completion receipts on (`checkpoint.completion_receipts`), a result
reply also carries `"receipt": {"rollout_id", "attempt", "digest"}` and the
result stays held until the trainer acknowledges that receipt (`ack`); the
stats then count `unacknowledged_results`.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from typing import Any

from aiohttp import web

from participants.common import ServerBase, guarded, json_object, want_int, want_str
from participants.environment import drive, environment_participant, expect_task, first_boundary
from ray_ckpt.clock import SYSTEM_CLOCK, Clock
from ray_ckpt.control.wire import to_builtins
from ray_ckpt.errors import CheckpointError, InvalidRequest
from ray_ckpt.identity import EpisodeId, rollout_path
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.steps import EpisodeSteps
from ray_ckpt.steps.receipts import ResultReceipts

MAX_STEPS = 1000


def parse_task(body: dict[str, Any]) -> tuple[EpisodeId, dict[str, Any]]:
    raw_id, task = body.get("episode_id"), body.get("task")
    if not isinstance(raw_id, dict) or not isinstance(task, dict):
        raise InvalidRequest("the body needs 'episode_id' and 'task' objects")
    unknown = sorted(set(raw_id) - {"rollout_id", "attempt"})
    if unknown:
        raise InvalidRequest(f"unknown episode_id fields {unknown}")
    episode = EpisodeId(want_str(raw_id, "rollout_id"), raw_id.get("attempt", 0))
    want_str(task, "task_id")
    want_int(task, "seed")
    want_int(task, "steps", low=1, high=MAX_STEPS)
    deadline_of(task)
    return episode, task


def deadline_of(task: dict[str, Any]) -> float | None:
    """`task.deadline_s`: absent or null, or a finite number of seconds > 0."""
    value = task.get("deadline_s")
    if value is None:
        return None
    # bool is an int subclass: `true` must not mean one second.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"'deadline_s' must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise InvalidRequest(f"'deadline_s' must be finite and > 0, got {value!r}")
    return float(value)


class EnvironmentServer(ServerBase):
    kind = "environment"

    def __init__(
        self,
        name: str,
        *,
        agent_url: str,
        resources_url: str,
        episode_timeout_s: float | None = None,
        clock: Clock = SYSTEM_CLOCK,
        receipts: ResultReceipts | None = None,
    ) -> None:
        super().__init__(name)
        self.agent_url = agent_url.rstrip("/")
        self.resources_url = resources_url.rstrip("/")
        self.episode_timeout_s = episode_timeout_s
        self.steps = EpisodeSteps(clock=clock)
        self.participant = environment_participant(self.steps, receipts)
        self.counters: Counter[str] = Counter()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/run", guarded(self.run))
        app.router.add_get("/stats", self.stats_route)
        return app

    async def run(self, request: web.Request) -> web.Response:
        self.calls["run"] += 1
        episode, task = parse_task(await json_object(request))
        self.check_attempt(episode)
        self.participant.refuse_finished(episode)
        deadline_s = deadline_of(task)
        ep = self.steps.begin(
            episode,
            deadline_s=self.episode_timeout_s if deadline_s is None else deadline_s,
            boundary=first_boundary(task),
            expect=expect_task(task),
        )
        reply: dict[str, Any] = {
            "episode_id": {"rollout_id": episode.rollout_id, "attempt": episode.attempt},
            "task_id": task["task_id"],
        }
        try:
            async with ep:
                deadline = ep.deadline() if ep.deadline_s is not None else None
                async with deadline or contextlib.nullcontext():
                    reply["result"] = await drive(ep, task, self, self.counters)
        except CheckpointError as exc:
            self.counters["failures"] += 1
            reply["failure"] = exc.to_body()["error"]
            return web.json_response(reply)
        # After the episode's end park point, so never while a checkpoint is
        # closed: the held results do not change under a capture.
        receipt = self.participant.hold(episode, reply["result"])
        if receipt is not None:
            reply["receipt"] = to_builtins(receipt)
        return web.json_response(reply)

    # --- the downstream calls of an episode ---------------------------------------
    async def seed(self, episode: EpisodeId, task: dict[str, Any]) -> tuple[str, dict[str, str]]:
        url = self.resources_url + rollout_path(episode, "/seed_session")
        body, headers = await self.downstream.post(
            url, {"task_id": task["task_id"], "seed": task["seed"]}
        )
        return str(body["observation"]), headers

    async def activate(self, episode: EpisodeId, step: int, observation: str) -> Any:
        url = self.agent_url + rollout_path(episode, "/activate")
        body, _ = await self.downstream.post(url, {"step": step, "observation": observation})
        return body["result"]

    async def verify(self, episode: EpisodeId, body: dict[str, Any]) -> dict[str, Any]:
        url = self.resources_url + rollout_path(episode, "/verify")
        verdict, _ = await self.downstream.post(url, body)
        return verdict

    async def close(self, episode: EpisodeId) -> None:
        # Best effort: the result stands even if a close is lost.
        for url in (
            self.agent_url + rollout_path(episode, "/close"),
            self.resources_url + rollout_path(episode, "/close_session"),
        ):
            with contextlib.suppress(CheckpointError):
                await self.downstream.post(url, {})

    def stats(self) -> dict[str, Any]:
        return {
            **self.base_stats(),
            **dict(self.counters),
            "live_episodes": self.steps.live_executions(),
            "restored_episodes": len(self.steps.restored_ids()),
            "unacknowledged_results": len(self.participant.receipts or ()),
        }


def environment_server(
    *,
    name: str,
    settings: CheckpointSettings,
    agent_url: str,
    resources_url: str,
    episode_timeout_s: float | None = None,
) -> EnvironmentServer:
    receipts = None
    if settings.enabled and settings.completion_receipts:
        receipts = ResultReceipts(
            max_results=settings.max_unacknowledged_results,
            max_bytes=settings.max_unacknowledged_bytes,
        )
    return EnvironmentServer(
        name,
        agent_url=agent_url,
        resources_url=resources_url,
        episode_timeout_s=episode_timeout_s,
        receipts=receipts,
    )
