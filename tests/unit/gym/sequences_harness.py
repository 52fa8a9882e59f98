"""The harness of the randomized sequence test (`test_sequences_random.py`).

One seed is one small, fast scenario of the whole reference fleet in this
process (no Ray): `tests.e2e.support_parity.LocalGym` (the fleet of
`participants.local` behind a `CoordinatorCore` whose `FakeHost`s call the
servers' own engines; a crash stops every server without draining, a
relaunch starts fresh ones) is reused as is, with three probes added to each
fleet it launches (`SeqGym.relaunch`):

- a *failing step*: the environment's agent activation of step K of a chosen
  rollout raises a typed error (`InvalidRequest`), every time it runs, so the
  uninterrupted run fails the same way;
- an *outcome gate*: an environment episode whose outcome leaves (the
  episode is freed) while the environment's admission is closed, or a model
  response delivered while the model's gate is closed, is a violation;
- the model's *collector*: `PolicyModelParticipant.collect`, the hand-off of
  a finished attempt's ledger rows.

`Scenario.draw(seed)` picks the fleet config, the tasks (step counts,
deadlines that never or always expire, failing steps) and the action count;
`uninterrupted` runs it with no control action, `Sequence` runs it with random
actions.  The environment's closing calls are
sometimes slow.  Outcomes are compared as ("result", digest) or ("failure", code).
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from coordination.demo.scenario import abandon_running, wait_running
from participants.fleet import FleetConfig
from participants.rollout import make_tasks, result_digest, run_episode
from ray_ckpt.errors import CheckpointError, InvalidRequest
from ray_ckpt.identity import EpisodeId
from tests.e2e.support_parity import LocalGym, crash_restore, env_keys

Outcome = tuple[str, str]  # ("result", digest) | ("failure", code) | ("error", code)
LedgerRow = tuple[int | None, str, int]  # (call position, conversation digest, tokens)

# A deadline that never expires, and one shorter than any episode's work
# (every fleet with a tiny deadline has slow tools), so both are deterministic.
# Every typed error and failure the driver saw (a failing seed prints them).
DETAILS: list[str] = []

LONG_DEADLINE_S = 60.0
TINY_DEADLINE_S = 0.001


@dataclass(frozen=True)
class Scenario:
    seed: int
    config: FleetConfig
    tasks: dict[str, dict[str, Any]]
    faults: dict[str, int]  # rollout -> the agent step that fails
    n_actions: int
    close_delay_s: float = 0.0  # the environment's closing calls (its last step)

    @classmethod
    def draw(cls, seed: int) -> Scenario:
        rng = random.Random(seed)
        step_delay = rng.choice([0.0, 0.002, 0.005])
        config = FleetConfig(
            token="seq-token",
            step_delay_s=step_delay,
            verify_delay_s=rng.choice([None, 0.0, 0.01]),
            token_delay_s=rng.choice([0.0, 0.0, 0.001]),
            tokens_per_turn=rng.randint(2, 4),
            turns_per_step=rng.randint(1, 2),
            verify_mode=rng.choice(["wait", "replay"]),
            model_seed=rng.randrange(1000),
            suffix=f"q{seed}",
        )
        tasks: dict[str, dict[str, Any]] = {}
        faults: dict[str, int] = {}
        for i in range(rng.randint(2, 4)):
            rollout = f"s{seed}r{i}"
            task = make_tasks(1, steps=rng.randint(1, 3), seed=seed * 100 + i)[0]
            deadlines: list[float | None] = [None, None, LONG_DEADLINE_S]
            if step_delay > 0:
                deadlines.append(TINY_DEADLINE_S)
            deadline = rng.choice(deadlines)
            if deadline is not None:
                task["deadline_s"] = deadline
            # Not with a tiny deadline: which of the two fails first is a race.
            if deadline != TINY_DEADLINE_S and rng.random() < 0.2:
                faults[rollout] = rng.randrange(int(task["steps"]))
            tasks[rollout] = task
        return cls(seed, config, tasks, faults, rng.randint(3, 9), rng.choice([0.0, 0.005]))


def project(rows: list[dict[str, Any]]) -> list[LedgerRow]:
    """What of a ledger row an uninterrupted run must reproduce: the caller's
    call position, the conversation and the tokens (not the admission index or
    how many tokens a restored cut supplied: bookkeeping of this fleet)."""
    return [(r.get("position"), str(r["digest"]), int(r["tokens"])) for r in rows]


class SeqGym(LocalGym):
    """`LocalGym` whose every fleet carries the failing steps and the probes."""

    def __init__(self, scenario: Scenario) -> None:
        super().__init__(scenario.config)
        self.faults = scenario.faults
        self.close_delay_s = scenario.close_delay_s
        self.violations: list[str] = []
        self.collected: dict[EpisodeId, list[list[LedgerRow]]] = defaultdict(list)

    async def relaunch(self) -> None:
        await super().relaunch()
        self._fail_steps(self.server("environment"))
        self._slow_close(self.server("environment"))
        self._gate_env(self.server("environment"))
        self._gate_model(self.server("model").participant)

    def _fail_steps(self, env: Any) -> None:
        activate = env.activate
        faults = self.faults

        async def failing(episode: EpisodeId, step: int, observation: str) -> Any:
            if faults.get(episode.rollout_id) == step:
                raise InvalidRequest(f"injected failure of step {step}")
            return await activate(episode, step, observation)

        env.activate = failing

    def _slow_close(self, env: Any) -> None:
        # A slow last step: an outcome is often on its way out when a checkpoint
        # closes, which is where an outcome could slip past the closed gate.
        close = env.close
        delay = self.close_delay_s

        async def slow(episode: EpisodeId) -> None:
            if delay:
                await asyncio.sleep(delay)
            await close(episode)

        env.close = slow

    def _gate_env(self, env: Any) -> None:
        steps = env.steps
        free: Callable[..., None] = steps._free

        def gated(ep: Any, *, completed: bool) -> None:
            # A retire's cancel, a crash's cancel and a restart never park: their
            # end is not an outcome the checkpoint could also continue.
            quiet = ep.closed or ep.retire_requested or ep.park_cancelled or ep.restart
            if not quiet and not steps.admission_open:
                self.violations.append(f"environment: {ep.key} ended while admission was closed")
            free(ep, completed=completed)

        steps._free = gated

    def _gate_model(self, part: Any) -> None:
        deliver: Callable[[Any], None] = part.deliver

        def gated(call: Any) -> None:
            if not part.gate.is_open:
                self.violations.append(f"model: {call.episode} delivered while admission closed")
            deliver(call)

        part.deliver = gated

        def collect(episode: EpisodeId, rows: list[dict[str, Any]]) -> None:
            self.collected[episode].append(project(rows))

        part.collect = collect


@dataclass
class Driver:
    """The caller: one `/run` per started attempt, and every outcome it got."""

    tasks: dict[str, dict[str, Any]]
    attempts: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, list[tuple[int, Outcome]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    running: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # capture key -> typed error

    def episode(self, rollout: str) -> EpisodeId:
        return EpisodeId(rollout, self.attempts.get(rollout, 0))

    def outcome(self, rollout: str) -> Outcome | None:
        """The outcome of the rollout's current attempt, if it came back."""
        attempt = self.attempts.get(rollout, 0)
        got = [o for a, o in self.outcomes.get(rollout, []) if a == attempt]
        return got[-1] if got else None

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
        episode = EpisodeId(rollout, attempt)

        async def drive() -> None:
            if delay_s:
                await asyncio.sleep(delay_s)
            got = await call(session, env_url, episode, task)
            if got[0] == "error":
                self.refused[episode.capture_key] = DETAILS[-1]
            self.outcomes[rollout].append((attempt, got))

        task = self.tasks[rollout]
        self.running[rollout] = asyncio.ensure_future(drive())

    async def wait(self, timeout_s: float) -> None:
        await wait_running(self.running, timeout_s)

    async def abandon(self) -> None:
        await abandon_running(self.running)


async def call(
    session: aiohttp.ClientSession, env_url: str, episode: EpisodeId, task: dict[str, Any]
) -> Outcome:
    try:
        reply = await run_episode(session, env_url, episode, task)
    except CheckpointError as exc:
        DETAILS.append(f"{episode.capture_key}: {exc!r}")
        return ("error", str(exc.to_body()["error"]["code"]))
    if "result" in reply:
        return ("result", result_digest(reply["result"]))
    DETAILS.append(f"{episode.capture_key}: {reply['failure']}")
    return ("failure", str(reply["failure"]["code"]))


@dataclass
class Run:
    """What one run of a scenario produced."""

    outcomes: dict[str, list[tuple[int, Outcome]]]
    attempts: dict[str, int]
    collected: dict[EpisodeId, list[list[LedgerRow]]]
    violations: list[str]


def final_outcomes(base: Run) -> dict[str, Outcome]:
    """Each rollout's one outcome in an uninterrupted run (a result or a failure)."""
    out = {}
    for rollout, got in base.outcomes.items():
        assert len(got) == 1, (rollout, got)
        outcome = got[0][1]
        assert outcome[0] in ("result", "failure"), (rollout, outcome)
        out[rollout] = outcome
    return out


async def uninterrupted(scenario: Scenario, session: aiohttp.ClientSession) -> Run:
    gym = SeqGym(scenario)
    await gym.relaunch()
    try:
        driver = Driver(scenario.tasks)
        for rollout in scenario.tasks:
            driver.start(session, gym.env_url, rollout)
        await driver.wait(timeout_s=30)
    finally:
        await gym.close()
    return Run(dict(driver.outcomes), dict(driver.attempts), dict(gym.collected), gym.violations)


class Sequence:
    """The engine: random actions and the duties that come with them."""

    def __init__(
        self,
        gym: SeqGym,
        driver: Driver,
        rng: random.Random,
        where: Path,
        session: aiohttp.ClientSession,
        expected: dict[str, Outcome],
    ) -> None:
        self.gym = gym
        self.driver = driver
        self.rng = rng
        self.where = where
        self.session = session
        self.expected = expected
        self.started: set[str] = set()
        self.retired: set[tuple[str, int]] = set()
        self.checkpoints: list[Path] = []
        # Committed and resumed (not crashed): (dir, scope), restored at the end.
        self.resumed: list[tuple[Path, list[EpisodeId]]] = []
        self.log: list[str] = []  # the actions, for a failing seed's report
        self.refusals: list[str] = []  # a mismatched or stale continuation not refused

    def pending(self) -> list[str]:
        return [r for r in self.driver.tasks if r not in self.started]

    def in_flight(self) -> list[str]:
        return sorted(r for r in self.started if self.driver.outcome(r) is None)

    def start(self, rollout: str, attempt: int = 0) -> None:
        self.started.add(rollout)
        # Sometimes late, so a checkpoint can name an attempt that has not begun.
        delay = self.rng.choice([0.0, 0.0, self.rng.uniform(0.001, 0.02)])
        self.driver.start(self.session, self.gym.env_url, rollout, attempt=attempt, delay_s=delay)

    async def hold(self) -> None:
        await asyncio.sleep(self.rng.choice([0.0, self.rng.uniform(0.0, 0.03)]))

    async def step(self) -> None:
        choices = ["progress"] * 2 + ["checkpoint"] * 2
        if self.pending():
            choices += ["start"] * 3
        if self.in_flight():
            choices += ["retire"]
        action = self.rng.choice(choices)
        if action == "start":
            rollout = self.rng.choice(self.pending())
            self.log.append(f"start {rollout}")
            self.start(rollout)
        elif action == "progress":
            self.log.append("progress")
            await asyncio.sleep(self.rng.uniform(0.0, 0.02))
        elif action == "checkpoint":
            await self.checkpoint(crash=self.rng.random() < 0.4)
        else:
            await self.retire(self.rng.choice(self.in_flight()))

    async def checkpoint(self, *, crash: bool) -> None:
        await self.hold()  # a random moment
        await self.gym.prepare()
        await self.hold()  # held open for a random time
        scope = [self.driver.episode(r) for r in self.in_flight()]
        where = self.where / f"c{len(self.checkpoints)}"
        self.log.append(f"{'crash' if crash else 'checkpoint'} {[e.capture_key for e in scope]}")
        await self.gym.commit(str(where), scope)
        self.checkpoints.append(where)
        await self.hold()
        if not crash:
            await self.gym.resume()
            self.resumed.append((where, scope))
            return
        restored = await crash_restore(self.gym, self.driver, str(where), scope)  # type: ignore[arg-type]
        continued = set(env_keys(restored))
        for episode in scope:
            nxt = episode.next()
            if nxt.capture_key in continued:
                await self.wrong_continuations(episode, nxt)
            self.start(episode.rollout_id, nxt.attempt)

    async def wrong_continuations(self, episode: EpisodeId, nxt: EpisodeId) -> None:
        """A continuation of another task and a re-run of the superseded attempt:
        both refused, and neither changes what the right continuation gets."""
        url = self.gym.env_url
        if self.rng.random() < 0.3:
            task = self.driver.tasks[episode.rollout_id]
            other = {**task, "seed": int(task["seed"]) + 1}
            got = await call(self.session, url, nxt, other)
            self.log.append(f"mismatched {nxt.capture_key} -> {got}")
            if got != ("error", "invalid_request"):
                self.refusals.append(f"mismatched continuation of {nxt.capture_key}: {got}")
        if self.rng.random() < 0.3:
            got = await call(self.session, url, episode, self.driver.tasks[episode.rollout_id])
            self.log.append(f"duplicate {episode.capture_key} -> {got}")
            if got != ("error", "stale_attempt"):
                self.refusals.append(f"superseded attempt {episode.capture_key} re-run: {got}")

    async def retire(self, rollout: str) -> None:
        episode = self.driver.episode(rollout)
        self.log.append(f"retire {episode.capture_key}")
        await self.gym.retire([episode])
        task = self.driver.running.get(rollout)
        if task is not None:
            # A delayed start still sends its /run (and is refused as stale).
            await asyncio.wait_for(asyncio.shield(task), 10)
        got = self.driver.outcome(rollout)
        if got is not None and (got[0] == "result" or got == self.expected[rollout]):
            return  # it ended before the retire reached it: the outcome stands
        self.retired.add((rollout, episode.attempt))
        self.start(rollout, episode.attempt + 1)

    async def finish(self) -> None:
        for rollout in self.pending():
            self.start(rollout)
        await self.driver.wait(timeout_s=30)


async def restores(scenario: Scenario, where: Path, scope: list[EpisodeId]) -> set[str]:
    """Restore a committed checkpoint into a fresh fleet; the environment keys."""
    gym = SeqGym(scenario)
    try:
        await gym.relaunch()
        result = await gym.restore(str(where), scope)
        await gym.resume()
    finally:
        await gym.close()
    return set(env_keys(result))
