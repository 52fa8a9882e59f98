"""A checkpoint-crash-restore run of the reference fleet, as reusable steps.

The main job (`ray-ckpt demo`) and the end-to-end suite build their runs from
these steps: drive rollouts against a fleet, checkpoint mid-flight through the
coordinator, crash every Gym actor, restore into a fresh fleet and continue
each unfinished rollout as attempt + 1, then compare with an uninterrupted run
of the same seeds.

A rollout is *finished* when its `/run` reply reached the driver; *continued*
when a restore installed its state and its next attempt ran to the end; and
*restarted* when no state of it survived, so its next attempt started over
from the task input.

With completion receipts on, the driver may *lose* replies (`lose_next`: the
next N results that arrive are dropped, as if the call failed after the Gym
finished); such a rollout is no longer in flight (`in_flight`) and is
*recovered by receipt*: `collect()` after a restore returns its result
(`recover`), and the driver acknowledges what it stored (`take_receipts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from participants.fleet import Fleet, FleetConfig, launch_fleet
from participants.rollout import make_tasks, result_digest, run_episode
from ray_ckpt.control.client import data_session
from ray_ckpt.errors import CheckpointError
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.root.history import RestartBias

OnEvent = Callable[[str, str], None]


def _quiet(_event: str, _rollout: str) -> None:
    return None


# Module functions, not `Rollouts` methods: the random-sequence harness
# drives its attempts with another record of outcomes and reuses these two.
async def wait_running(running: dict[str, asyncio.Task[None]], timeout_s: float | None) -> None:
    """Wait for every running attempt to reply or fail (TimeoutError past `timeout_s`)."""
    tasks = list(running.values())
    if tasks:
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*tasks)


async def abandon_running(running: dict[str, asyncio.Task[None]]) -> None:
    """Cancel every running attempt, await each, and forget them all."""
    for task in running.values():
        task.cancel()
    for task in running.values():
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    running.clear()


@dataclass
class Rollouts:
    """One task per rollout, its current attempt, and what came back."""

    tasks: dict[str, dict[str, Any]]
    attempts: dict[str, int] = field(default_factory=dict)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    running: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    on_event: OnEvent = _quiet
    first_start: float | None = None  # monotonic time the first attempt was dispatched
    finished_at: dict[str, float] = field(default_factory=dict)
    # Completion receipts: each delivered result's receipt, not yet acknowledged.
    receipts: dict[str, dict[str, Any]] = field(default_factory=dict)
    lose_next: int = 0  # drop the next N results that arrive (a lost reply)
    lost_replies: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)  # results collected by receipt

    @classmethod
    def make(cls, n: int, steps: int, seed: int, *, prefix: str = "r") -> Rollouts:
        tasks = make_tasks(n, steps, seed)
        return cls({f"{prefix}{i}": t for i, t in enumerate(tasks)})

    def episode(self, rollout: str) -> EpisodeId:
        return EpisodeId(rollout, self.attempts.get(rollout, 0))

    def unfinished(self) -> list[EpisodeId]:
        return [self.episode(r) for r in self.tasks if r not in self.results]

    def in_flight(self) -> list[EpisodeId]:
        """The unfinished rollouts still awaited: a lost reply is not work to
        resume (its result waits at the Gym for `collect`)."""
        lost = set(self.lost_replies) - set(self.results)
        return [e for e in self.unfinished() if e.rollout_id not in lost]

    def take_receipts(self) -> list[dict[str, Any]]:
        """The receipts of the results stored since the last call (to acknowledge)."""
        out = list(self.receipts.values())
        self.receipts.clear()
        return out

    def recover(self, collected: Iterable[Any]) -> list[dict[str, Any]]:
        """Store the results `collect()` returned (`.participant`, `.receipt`,
        `.result`) for rollouts still awaiting one; returns every collected
        receipt, to acknowledge (one already stored here is acknowledged too)."""
        receipts: list[dict[str, Any]] = []
        for item in collected:
            receipt = msgspec.to_builtins(item.receipt)
            receipts.append(receipt)
            rollout = receipt["rollout_id"]
            if rollout in self.tasks and rollout not in self.results:
                self.results[rollout] = item.result
                self.finished_at[rollout] = time.monotonic()
                self.recovered.append(rollout)
                self.on_event("finished", rollout)
        return receipts

    def start(
        self,
        session: aiohttp.ClientSession,
        env_url: str,
        rollout: str,
        *,
        attempt: int = 0,
        delay_s: float = 0.0,
    ) -> None:
        self.attempts[rollout] = attempt
        self.failures.pop(rollout, None)
        if self.first_start is None:
            self.first_start = time.monotonic()
        episode = EpisodeId(rollout, attempt)

        async def drive() -> None:
            if delay_s:
                await asyncio.sleep(delay_s)
            try:
                reply = await run_episode(session, env_url, episode, self.tasks[rollout])
            except CheckpointError as exc:
                self.failures[rollout] = str(exc)
                self.on_event("failed", rollout)
                return
            if "result" in reply and self.lose_next > 0:
                self.lose_next -= 1
                self.lost_replies.append(rollout)
                self.on_event("lost", rollout)
                return
            if "result" in reply:
                if "receipt" in reply:
                    self.receipts[rollout] = reply["receipt"]
                self.results[rollout] = reply["result"]
                self.finished_at[rollout] = time.monotonic()
                self.on_event("finished", rollout)
            else:
                self.failures[rollout] = str(reply.get("failure"))
                self.on_event("failed", rollout)

        self.running[rollout] = asyncio.ensure_future(drive())

    async def wait(self, timeout_s: float | None = None) -> None:
        """Wait for every running attempt to reply or fail."""
        await wait_running(self.running, timeout_s)

    async def abandon(self) -> None:
        """The driver's side of a crash: in-flight calls are gone."""
        await abandon_running(self.running)

    def span_s(self) -> float:
        """From the first dispatch to the last result (0 before anything finished)."""
        if self.first_start is None or not self.finished_at:
            return 0.0
        return max(self.finished_at.values()) - self.first_start

    def digests(self) -> dict[str, str]:
        return {r: result_digest(res) for r, res in sorted(self.results.items())}


@dataclass
class Baseline:
    """The uninterrupted run a checkpointed one must equal: each rollout's
    digest, the servers' `/stats` at its end, and how long it took."""

    expected: dict[str, str]
    stats: dict[str, dict[str, Any]]
    span_s: float


async def baseline(
    config: FleetConfig,
    rollouts: int,
    steps: int,
    seed: int,
    *,
    stagger_s: float,
    advance: Callable[[], None],
) -> Baseline:
    """`uninterrupted` for the demo's modes: the same seeds, `advance` at each event."""
    base = Rollouts.make(rollouts, steps, seed)
    base.on_event = lambda _e, _r: advance()
    stats: dict[str, dict[str, Any]] = {}
    expected = await uninterrupted(config, base, stagger_s=stagger_s, stats_out=stats)
    return Baseline(expected, stats, base.span_s())


async def uninterrupted(
    config: FleetConfig,
    rollouts: Rollouts,
    *,
    stagger_s: float = 0.0,
    stats_out: dict[str, dict[str, Any]] | None = None,
) -> dict[str, str]:
    """Run every rollout to the end on a fleet nobody checkpoints; their digests.

    `stats_out`, when given, receives the servers' `/stats` at the end (the
    work an uninterrupted run costs, to measure what a crash regenerates).
    """
    fleet = await launch_fleet(config)
    try:
        async with data_session(1024, 512) as session:
            for i, rollout in enumerate(rollouts.tasks):
                rollouts.start(session, fleet.urls["environment"], rollout, delay_s=i * stagger_s)
            await rollouts.wait()
        if stats_out is not None:
            stats_out.update(await fleet_stats(fleet))
    finally:
        await fleet.stop()
    if rollouts.failures:
        raise RuntimeError(f"uninterrupted run failed: {rollouts.failures}")
    return rollouts.digests()


async def fleet_stats(fleet: Fleet) -> dict[str, dict[str, Any]]:
    """Each server's `/stats` (read before a crash: counters die with the process)."""
    out: dict[str, dict[str, Any]] = {}
    async with data_session(16, 16) as session:
        for kind, url in fleet.urls.items():
            async with session.get(url.rstrip("/") + "/stats") as resp:
                out[kind] = await resp.json()
    return out


async def wait_for_mixed_work(fleet: Fleet, rollouts: Rollouts, timeout_s: float) -> dict[str, int]:
    """Poll `/stats` until work is in every state (a generation, a tool call and a
    verify in flight), or the timeout; returns what was in flight."""
    deadline = time.monotonic() + timeout_s
    seen: dict[str, int] = {}
    while time.monotonic() < deadline and len(rollouts.results) < len(rollouts.tasks):
        stats = await fleet_stats(fleet)
        routes = stats["resources"].get("inflight_by_route", {})
        seen = {
            "generating": int(stats["model"].get("generating", 0)),
            "tool_calls": sum(v for k, v in routes.items() if k not in ("verify", "seed_session")),
            "verifying": int(routes.get("verify", 0)),
            "episodes": int(stats["environment"].get("live_episodes", 0)),
        }
        if seen["generating"] and seen["tool_calls"] and seen["verifying"]:
            break
        await asyncio.sleep(0.02)
    return seen


@dataclass
class Continuation:
    """What a restore made of the unfinished rollouts."""

    continued: list[str]
    restarted: list[str]
    restored_keys: dict[str, list[str]]
    restore_s: float
    recovered: list[str] = field(default_factory=list)  # results collected by receipt
    # The restore's restart bias: {steps bucket: {continued, restarted, lost}}.
    restart_bias: dict[str, dict[str, int]] = field(default_factory=dict)
    # ... and the tokens its episodes had generated: {bucket: {outcome: n}}, where known.
    restart_bias_tokens: dict[str, dict[str, int]] = field(default_factory=dict)


async def restore_and_continue(
    handle: Any,
    fleet: Fleet,
    session: aiohttp.ClientSession,
    checkpoint_dir: str,
    scope: Iterable[EpisodeId],
    rollouts: Rollouts,
    *,
    collect: bool = False,
) -> Continuation:
    """Restore `scope` into `fleet` (fresh hosts), resume, and start attempt + 1 of
    every unfinished rollout: from its restored boundary when the environment
    installed one, else from the task input.  `collect`: first take back the
    finished results the checkpoint held (completion receipts) and
    acknowledge them; those rollouts are done, not continued."""
    scope = list(scope)
    result = await handle.arestore(checkpoint_dir, scope)
    recovered: list[str] = []
    if collect:
        before = len(rollouts.recovered)
        receipts = rollouts.recover((await handle.acollect()).results)
        if receipts:
            await handle.aack(receipts)
        recovered = rollouts.recovered[before:]
    env_keys = set()
    for participant, keys in result.restored.items():
        if participant.startswith("environment/"):
            env_keys.update(keys)
    continued: list[str] = []
    restarted: list[str] = []
    for episode in rollouts.unfinished():
        nxt = episode.next()
        (continued if nxt.capture_key in env_keys else restarted).append(episode.rollout_id)
        rollouts.start(session, fleet.urls["environment"], episode.rollout_id, attempt=nxt.attempt)
    bias, tokens = bias_tables(result.restart_bias)
    return Continuation(
        continued, restarted, result.restored, result.total_s, recovered, bias, tokens
    )


def bias_tables(
    bias: RestartBias | None,
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """A restore's restart bias as the demo shows it: by bucket, the episodes
    per outcome and the tokens per outcome where known ({} without a bias)."""
    return ({}, {}) if bias is None else (bias.as_table(), bias.tokens_table())


async def crash(fleet: Fleet, rollouts: Rollouts) -> None:
    """Kill every Gym actor (no draining), then drop the driver's in-flight calls."""
    rollouts.lose_next = 0  # replies are lost up to the crash, not after it
    # Receipts of the dead fleet cannot be acknowledged any more: a result the
    # checkpoint carried is offered again by `collect()` after the restore.
    rollouts.receipts.clear()
    fleet.kill()
    await rollouts.abandon()


@dataclass
class Resumed:
    """What a restore made of a stopped run's rollouts."""

    checkpoint_dir: str
    checkpoint_id: str
    continued: list[str]
    restarted: list[str]
    # The restore's restart bias, as `Continuation` has it.
    restart_bias: dict[str, dict[str, int]] = field(default_factory=dict)
    restart_bias_tokens: dict[str, dict[str, int]] = field(default_factory=dict)


async def resume_stopped_run(
    handle: Any,
    session: aiohttp.ClientSession,
    env_url: str,
    location: str,
    state: Any,
    rollouts: Rollouts,
) -> Resumed:
    """Restore every episode the checkpoint at `location` lists into the
    (fresh) fleet and start attempt + 1 of each rollout the stopped driver had
    not finished (`state`: its results and attempts at that checkpoint): from
    the restored boundary when the environment installed one, else over."""
    result = await handle.arestore(location)
    rollouts.results.update(state.results)
    rollouts.attempts.update(state.attempts)
    env_keys = {
        key
        for participant, keys in result.restored.items()
        if participant.startswith("environment/")
        for key in keys
    }
    continued: list[str] = []
    restarted: list[str] = []
    for episode in rollouts.unfinished():
        nxt = episode.next()
        (continued if nxt.capture_key in env_keys else restarted).append(episode.rollout_id)
        rollouts.start(session, env_url, episode.rollout_id, attempt=nxt.attempt)
    source = result.source_checkpoint_id or result.checkpoint_id
    bias, tokens = bias_tables(result.restart_bias)
    return Resumed(result.checkpoint_dir, source, continued, restarted, bias, tokens)
