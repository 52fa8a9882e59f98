"""The harness of the seeded fault-injection simulation (`test_gym_simulation.py`).

One seed is one whole Gym in this process, no Ray: the reference fleet
(`participants.local`, four kinds on loopback HTTP, each with its real
`ParticipantEngine` and a real `FileRecordStore` on a temporary
directory) behind a real `CoordinatorCore` with the real Gym manifest and
`LATEST` writers and readers.  Its hosts are `SimHost`s: `FakeHost`s that can
lose a reply after the participant acted.  The triggers are the real ones
where they carry logic: the drain is a `DrainWatcher` driving the Ray
coordinator's own `CoordinatorDrainActions` (over `SimCoordinator`, the
Ray-free part of the actor it needs); periodic is the loop's checkpoint plus
`coordination.engine.roots.retain`; signal is the signal handler's call with a
grace budget (`cut_budget`).

`SimScenario.draw(seed)` draws the Gym (receipts on or off, a full or an
incremental store, step timings, verify mode), the tasks, which faults may
happen and how many actions run.  `Trainer` is the caller: one `/run` per
started attempt, the results it holds (rolled back to its own snapshot when
the Gym is restored from a checkpoint: a trainer restores its state from the
same step), the receipts it acks, the attempts it retired.  `Simulation`
runs the random actions and checks the invariants after every one
(`check`), and at the end (`finish`); each broken one is a line in
`violations`, which the test prints with the actions that led to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from coordination.actor.drain_control import CoordinatorDrainActions
from coordination.demo.scenario import abandon_running
from coordination.engine import receipts as gym_receipts
from coordination.engine.coordinator_core import CoordinatorCore
from coordination.engine.manifests import write_gym_manifest_from_replies
from coordination.engine.order import Member
from coordination.engine.results import RestoreResult, Timeouts
from coordination.engine.roots import restore_target, retain, write_latest_quietly
from coordination.reach.hosts import FakeHost
from coordination.triggers.drain import DrainWatcher
from coordination.triggers.signal_budget import cut_budget
from participants.fleet import KIND_ORDER, FleetConfig
from participants.rollout import make_tasks, result_digest, run_episode
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import (
    AdmissionClosed,
    CheckpointError,
    CoordinationFailed,
    InvalidCheckpointState,
    ParticipantUnavailable,
    UnknownReceipt,
)
from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import Receipt
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage import open_location, read_gym_manifest, verify_checkpoint
from ray_ckpt.storage.root.pointer import read_latest
from ray_ckpt.storage.seam import FileRecordStore
from tests.e2e.conftest import until
from tests.unit.gym.sequences_harness import Scenario, SeqGym
from tests.unit.workers.inprocess_workers import (
    TOKEN,
    Hold,
    InProcessPool,
    make_workers_participant,
)

Outcome = tuple[str, str]  # ("result", digest) | ("failure", code)

SIM_TIMEOUTS = Timeouts(
    prepare_s=5.0,
    commit_s=5.0,
    resume_s=5.0,
    restore_s=5.0,
    retire_s=5.0,
    status_s=2.0,
    pause_s=2.0,
    renew_every_s=3600.0,
    reply_grace_s=0.5,
    cleanup_min_s=2.0,
)

# The faults a seed may draw; each drawn one is then injected at random moments.
FAULTS = (
    "write_fail",  # a participant's records write raises
    "write_slow",  # a participant's records write is slow
    "manifest_delay",  # the Gym manifest write is delayed
    "latest_delay",  # the LATEST write is delayed
    "reply_lost",  # a participant acted, its reply never reached the coordinator
    "member_death",  # a Gym server dies (idle, prepared, committed, writing, restored)
    "relaunch_fail",  # a drain's relaunch finds no room
    "deadline",  # a checkpoint's prepare deadline passes mid-step
    "retry_dir",  # a failed checkpoint is retried into the same directory
    "restore_live",  # a restore aimed at the live fleet
    "worker_death",  # one worker of the multi-worker server dies (idle, restored, resumed)
)
# The result of a side rollout: one step, continued or not (`EnvLikeServer.run`).
SIDE_RESULT = {"steps": 1}
# Checkpoint triggers and ways a trainer takes one.
CHECKPOINTS = ("whole_sync", "whole_async", "split", "periodic", "signal", "drain")


@dataclass(frozen=True)
class SimScenario:
    seed: int
    base: Scenario  # the fleet and tasks (the uninterrupted run's scenario)
    full_every: int  # 1: every checkpoint full; more: incremental chains
    faults: frozenset[str]
    n_actions: int
    # Workers of the multi-worker environment server beside the fleet (0: none)
    # and the rollouts it serves (`EnvLikeServer`: one step, then held live).
    workers: int = 0
    side: tuple[str, ...] = ()

    @property
    def config(self) -> FleetConfig:
        return self.base.config

    @classmethod
    def draw(cls, seed: int) -> SimScenario:
        rng = random.Random(f"sim-{seed}")
        step_delay = rng.choice([0.0, 0.002, 0.004])
        config = FleetConfig(
            token="sim-token",
            step_delay_s=step_delay,
            verify_delay_s=rng.choice([None, 0.0]),
            token_delay_s=rng.choice([0.0, 0.0, 0.0005]),
            tokens_per_turn=rng.randint(2, 3),
            turns_per_step=rng.randint(1, 2),
            verify_mode=rng.choice(["wait", "replay"]),
            model_seed=rng.randrange(1000),
            suffix=f"g{seed}",
            completion_receipts=rng.random() < 0.5,
        )
        tasks: dict[str, dict[str, Any]] = {}
        for i in range(rng.randint(3, 5)):
            tasks[f"g{seed}r{i}"] = make_tasks(1, steps=rng.randint(1, 4), seed=seed * 100 + i)[0]
        base = Scenario(seed, config, tasks, {}, 0, 0.0)
        faults = frozenset(f for f in FAULTS if rng.random() < 0.4)
        workers = rng.choice([0, 2, 2, 3])
        side = tuple(f"g{seed}w{i}" for i in range(rng.randint(2, 4))) if workers else ()
        if not workers:
            faults -= {"worker_death"}
        return cls(seed, base, rng.choice([1, 2, 8]), faults, rng.randint(8, 16), workers, side)

    @property
    def side_key(self) -> str:
        return f"environment/side-g{self.seed}"


class FaultyStore:
    """The participant's real store, whose next write may fail or be slow."""

    def __init__(self, inner: FileRecordStore, gym: SimGym, key: str) -> None:
        self.inner = inner
        self.gym = gym
        self.key = key

    def new_stop(self) -> Any:
        return self.inner.new_stop()

    def write(self, checkpoint_dir: str, **kw: Any) -> Any:
        # Runs on a worker thread; the decision was armed on the loop.
        if self.key in self.gym.fail_writes:
            self.gym.fail_writes.discard(self.key)
            raise InvalidCheckpointState(f"injected: the records write of {self.key} failed")
        if self.key in self.gym.slow_writes:
            self.gym.slow_writes.discard(self.key)
            time.sleep(0.03)
        return self.inner.write(checkpoint_dir, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class SimHost(FakeHost):
    """A host whose reply to one armed operation is lost after the participant acted."""

    def __init__(self, member: Member, target: Any, gym: SimGym) -> None:
        super().__init__(member, target)
        self.gym = gym

    async def call(self, op: str, body: Any) -> dict[str, Any]:
        lost = self.gym.lose_replies.get(self.member.key) == op
        if lost:
            del self.gym.lose_replies[self.member.key]
        reply = await super().call(op, body)
        if lost:
            raise ParticipantUnavailable(
                f"injected: the reply of {self.member.key} to {op} was lost"
            )
        return reply


@dataclass
class SideServer:
    """The multi-worker environment server: real `WorkersParticipant` and worker
    runtimes over an in-process pool (`tests.unit.workers.inprocess_workers`)."""

    participant: Any
    pool: InProcessPool
    engine: ParticipantEngine
    stopped: bool = False

    async def run(self, episode: EpisodeId, **kw: Any) -> dict[str, Any]:
        """A data call of `episode` on its worker, retrying `admission_closed`;
        the worker's death fails it (`ParticipantUnavailable`), as a kill -9
        ends the connection of a call in flight."""
        while True:
            wid = self.pool.owner(episode.rollout_id)
            worker = self.pool._workers.get(wid)
            if worker is None or self.stopped:
                raise ParticipantUnavailable(f"the worker of {episode} is gone")
            call = asyncio.ensure_future(worker.runtime.server.run(episode, **kw))
            try:
                await asyncio.wait({call, worker.dead}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                call.cancel()
                raise
            if not call.done():
                call.cancel()
                with contextlib.suppress(BaseException):
                    await call
                raise ParticipantUnavailable(f"the worker of {episode} died")
            if call.cancelled():
                # Stopped on the server's side (a retire cancels the attempt's
                # handler): the caller's connection ends without a reply.
                raise ParticipantUnavailable(f"the call of {episode} was stopped")
            try:
                reply: dict[str, Any] = call.result()
                return reply
            except AdmissionClosed:
                await asyncio.sleep(0.005)

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        await self.engine.aclose()
        await self.participant.aclose()
        await self.pool.stop()


class SimGym(SeqGym):
    """The reference fleet with the probes of `SeqGym` and the faults above."""

    def __init__(self, scenario: SimScenario) -> None:
        super().__init__(scenario.base)
        self.sim = scenario
        self.core = CoordinatorCore(
            timeouts=SIM_TIMEOUTS,
            manifest_writer=self._write_manifest,
            latest_writer=self._write_latest,
        )
        self.manifest_delay_s = 0.0
        self.latest_delay_s = 0.0
        self.fail_writes: set[str] = set()
        self.slow_writes: set[str] = set()
        self.lose_replies: dict[str, str] = {}
        self.dead: set[str] = set()
        # Capture key -> did its run begin at a restored boundary (each fleet).
        self.began: dict[str, bool] = {}
        self.side: SideServer | None = None

    def _write_manifest(self, d: str, cid: str, manifests: list[dict[str, Any]]) -> Any:
        # One write is slow (the next checkpoint's is not): so a later
        # checkpoint can publish before an earlier one that is still writing.
        delay, self.manifest_delay_s = self.manifest_delay_s, 0.0
        if delay:
            time.sleep(delay)
        return write_gym_manifest_from_replies(d, cid, manifests)

    def _write_latest(self, d: str, cid: str) -> None:
        delay, self.latest_delay_s = self.latest_delay_s, 0.0
        if delay:
            time.sleep(delay)
        write_latest_quietly(d, cid)

    @property
    def keys(self) -> list[str]:
        return sorted(h.member.key for h in self.hosts)

    async def relaunch(self) -> None:
        await super().relaunch()
        assert self.fleet is not None
        self.dead = set()
        self.began = {}
        hosts: list[FakeHost] = []
        for host in self.hosts:
            ctrl = host.target
            assert ctrl is not None
            key = host.member.key
            inner = FileRecordStore(full_every=self.sim.full_every)
            ctrl.store = FaultyStore(inner, self, key)  # type: ignore[attr-defined]
            sim_host = SimHost(host.member, ctrl, self)
            self.core.register(sim_host)
            hosts.append(sim_host)
        if self.sim.workers:
            hosts.append(await self._launch_side())
        self.hosts = hosts
        self._watch_begins(self.server("environment"))

    async def _launch_side(self) -> SimHost:
        receipts = self.sim.config.completion_receipts
        participant, pool = make_workers_participant(
            "environment", self.sim.workers, completion_receipts=receipts
        )
        key = self.sim.side_key
        member = Member.parse(key)
        settings = CheckpointSettings.model_validate(
            {"enabled": True, "control_auth_token": TOKEN, "completion_receipts": receipts}
        )
        inner = FileRecordStore(full_every=self.sim.full_every)
        ctrl = ParticipantEngine(
            participant,
            instance=member.name,
            settings=settings,
            store=FaultyStore(inner, self, key),  # type: ignore[arg-type]
        )
        await pool.reported()
        self.side = SideServer(participant, pool, ctrl)
        host = SimHost(member, ctrl, self)
        self.core.register(host)
        return host

    def _watch_begins(self, env: Any) -> None:
        begin: Callable[..., Any] = env.steps.begin
        began = self.began

        def watched(episode_id: EpisodeId, **kw: Any) -> Any:
            ep = begin(episode_id, **kw)
            began.setdefault(episode_id.capture_key, ep.on_restored)
            return ep

        env.steps.begin = watched

    async def close(self) -> None:
        if self.side is not None:
            await self.side.stop()
            self.side = None
        await super().close()

    def engines(self) -> dict[str, Any]:
        return {h.member.key: h.target for h in self.hosts if h.member.key not in self.dead}

    async def kill(self, key: str) -> None:
        """One Gym server dies: its host answers nothing, its server is gone."""
        assert self.fleet is not None
        host = next(h for h in self.hosts if h.member.key == key)
        host.dead = True
        self.dead.add(key)
        if key == self.sim.side_key:
            assert self.side is not None
            await self.side.stop()
        else:
            await self.fleet.servers[host.member.kind].stop()

    async def crash_all(self) -> None:
        """Every server of the fleet dies (the driver's calls were abandoned)."""
        for host in self.hosts:
            host.dead = True
        if self.side is not None:
            await self.side.stop()
            self.side = None
        fleet, self.fleet = self.fleet, None
        if fleet is not None:
            await fleet.stop()
            model = fleet.server("model").participant

            async def dropped() -> bool:
                return not model.calls

            await until(dropped, "the cancelled model calls to drop", timeout_s=5, poll_s=0.005)


class SimCoordinator:
    """What `CoordinatorDrainActions` needs of the `Coordinator` actor, without Ray:
    its core, its scope source, and its restore (`Coordinator.restore`)."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.gym = sim.gym
        self.scope_source = sim._scope_source

    @property
    def core(self) -> CoordinatorCore:
        return self.gym.core

    async def _ready(self, *, discover: bool = False, refresh: bool = False) -> None:
        return None  # the in-process hosts are registered as they launch

    async def restore(
        self, checkpoint_dir: str, episode_ids: list[EpisodeId] | None = None
    ) -> RestoreResult:
        where, episodes = await restore_target(checkpoint_dir, episode_ids, latest=False)
        return await self.core.restore(where, episodes)


class SimDrainActions(CoordinatorDrainActions):
    """The coordinator's drain actions; where hosts run is the simulation's, and
    the trainer saves its state with each drain checkpoint."""

    @property
    def sim(self) -> Simulation:
        shim: SimCoordinator = self.coordinator  # type: ignore[assignment]
        return shim.sim

    async def placement(self) -> dict[str, str]:
        gym = self.sim.gym
        return {k: "node-a" for k in gym.keys if k not in gym.dead}

    async def checkpoint(self, location: str, budget: Any) -> Any:
        sim = self.sim
        sim.n += 1
        sim.attempted[location] = sim.n
        sim.log.append(f"  drain checkpoint {Path(location).name}")
        result = await super().checkpoint(location, budget)
        sim._saved(location, result)
        return result


class DrainingNode:
    """A `DrainSource`: node-a drains with a generous deadline while set."""

    def __init__(self) -> None:
        self.on = False

    def draining(self) -> dict[str, float | None]:
        return {"node-a": time.time() + 60.0} if self.on else {}


@dataclass
class Snapshot:
    """The trainer's own state at a checkpoint (what it saves beside the Gym's)."""

    attempts: dict[str, int]
    started: set[str]
    results: dict[str, Outcome]
    held: dict[str, Receipt]
    scope: list[EpisodeId]
    retired: set[str] = field(default_factory=set)
    continuations: set[str] = field(default_factory=set)


@dataclass
class Trainer:
    """The caller of the Gym: its runs, its results, its receipts."""

    tasks: dict[str, dict[str, Any]]
    attempts: dict[str, int] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    results: dict[str, Outcome] = field(default_factory=dict)
    held: dict[str, Receipt] = field(default_factory=dict)  # received, not acked
    running: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    retired: set[str] = field(default_factory=set)  # capture keys it retired
    # Continuations of a restore, by capture key: a stale refusal of one is the
    # participant saying it lost that state (typed), not a silent restart.
    continuations: set[str] = field(default_factory=set)
    refusals: list[str] = field(default_factory=list)  # typed refusals, for the report
    problems: list[str] = field(default_factory=list)  # invariants broken

    def episode(self, rollout: str) -> EpisodeId:
        return EpisodeId(rollout, self.attempts.get(rollout, 0))

    def in_flight(self) -> list[str]:
        return sorted(r for r in self.started if r not in self.results)

    def scope(self) -> list[EpisodeId]:
        return [self.episode(r) for r in self.in_flight()]

    def snapshot(self) -> Snapshot:
        return Snapshot(
            dict(self.attempts),
            set(self.started),
            dict(self.results),
            dict(self.held),
            self.scope(),
            set(self.retired),
            set(self.continuations),
        )

    def rollback(self, snap: Snapshot | None) -> None:
        """The trainer's state back to `snap` (None: nothing started)."""
        snap = snap or Snapshot({}, set(), {}, {}, [])
        self.attempts = dict(snap.attempts)
        self.started = set(snap.started)
        self.results = dict(snap.results)
        self.held = dict(snap.held)
        self.retired = set(snap.retired)
        self.continuations = set(snap.continuations)

    def accept(self, rollout: str, outcome: Outcome, receipt: Receipt | None, via: str) -> None:
        had = self.results.get(rollout)
        if had is not None:
            if had != outcome:
                self.problems.append(f"{rollout}: {via} delivered {outcome}, it had {had}")
            elif via == "run":
                self.problems.append(f"{rollout}: its result was delivered twice ({via})")
        else:
            self.results[rollout] = outcome
        if receipt is not None:
            self.held[rollout] = receipt


class Simulation:
    """One seed's run: random actions over a `SimGym`, invariants after each."""

    def __init__(
        self,
        scenario: SimScenario,
        expected: dict[str, Outcome],
        where: Path,
        session: aiohttp.ClientSession,
    ) -> None:
        self.scenario = scenario
        self.rng = random.Random(f"run-{scenario.seed}")
        self.root = where / "root"
        self.root.mkdir(parents=True)
        self.session = session
        self.gym = SimGym(scenario)
        self.trainer = Trainer(scenario.base.tasks)
        self.rollouts = [*scenario.base.tasks, *scenario.side]
        self.expected = {
            **expected,
            **{r: ("result", result_digest(SIDE_RESULT)) for r in scenario.side},
        }
        self.holds: dict[str, Hold] = {}  # side rollout -> its live attempt's hold
        self.log: list[str] = []
        self.violations: list[str] = []
        self.n = 0  # checkpoint directories made so far
        # Checkpoint dir -> the order it was last attempted in (the newest complete
        # one is what LATEST must name) and what the trainer saved with it.
        self.attempted: dict[str, int] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self.captured: dict[str, list[str]] = {}  # dir -> environment keys exported
        self.pending: dict[str, str] = {}  # async checkpoint id -> dir
        self.deleted: set[str] = set()  # dirs retention deleted
        self._saving: Snapshot | None = None
        self.source = DrainingNode()
        self.coordinator = SimCoordinator(self)
        self.relaunch_failures = 0
        self.worker_deaths = 0
        self.watcher = DrainWatcher(
            self.source,
            SimDrainActions(self.coordinator, self._relaunch),  # type: ignore[arg-type]
            str(self.root),
            wall=time.time,
        )

    def has(self, fault: str) -> bool:
        return fault in self.scenario.faults

    def chance(self, fault: str, p: float = 0.3) -> bool:
        return self.has(fault) and self.rng.random() < p

    # --- the trainer's runs ------------------------------------------------------
    def start(self, rollout: str, attempt: int = 0) -> None:
        if rollout in self.scenario.side:
            self.start_side(rollout, attempt)
            return
        t = self.trainer
        t.started.add(rollout)
        t.attempts[rollout] = attempt
        episode = EpisodeId(rollout, attempt)
        task = t.tasks[rollout]
        delay = self.rng.choice([0.0, 0.0, self.rng.uniform(0.001, 0.01)])
        url = self.gym.env_url

        async def drive() -> None:
            if delay:
                await asyncio.sleep(delay)
            try:
                reply = await run_episode(self.session, url, episode, task)
            except CheckpointError as exc:
                self._refused(episode, exc)
                return
            if t.attempts.get(rollout) != attempt:
                return  # a superseded attempt's late reply
            if episode.capture_key in t.retired and "result" not in reply:
                return  # stopped by its retire: the trainer runs the next attempt
            if "result" in reply:
                receipt = reply.get("receipt")
                got = Receipt(**receipt) if isinstance(receipt, dict) else None
                t.accept(rollout, ("result", result_digest(reply["result"])), got, "run")
            else:
                t.accept(rollout, ("failure", str(reply["failure"]["code"])), None, "run")

        old = t.running.get(rollout)
        if old is not None and not old.done():
            old.cancel()
        t.running[rollout] = asyncio.ensure_future(drive())

    def start_side(self, rollout: str, attempt: int) -> None:
        """A side rollout: one step on the multi-worker server, then live at its
        boundary until the trainer lets it end (`release`); a continuation of a
        restored attempt runs no step of its own and must find that step."""
        t = self.trainer
        t.started.add(rollout)
        t.attempts[rollout] = attempt
        episode = EpisodeId(rollout, attempt)
        continuing = episode.capture_key in t.continuations
        hold = None if continuing else Hold()
        side = self.gym.side

        async def drive() -> None:
            try:
                if side is None:
                    raise ParticipantUnavailable("no multi-worker server is running")
                reply = await side.run(
                    episode, steps=0 if continuing else 1, finish=True, hold=hold
                )
            except CheckpointError as exc:
                self._refused(episode, exc)
                return
            if t.attempts.get(rollout) != attempt or episode.capture_key in t.retired:
                return
            if continuing and not reply["continued"]:
                t.problems.append(f"{episode.capture_key} was restored, its run began from scratch")
            receipt = reply.get("receipt")
            got = Receipt(**receipt) if isinstance(receipt, dict) else None
            t.accept(rollout, ("result", result_digest({"steps": reply["steps"]})), got, "run")

        if hold is not None:
            self.holds[rollout] = hold
        old = t.running.get(rollout)
        if old is not None and not old.done():
            old.cancel()
        t.running[rollout] = asyncio.ensure_future(drive())

    def release(self, everything: bool = False) -> None:
        """Let some held side rollouts end (all of them with `everything`)."""
        for rollout, hold in list(self.holds.items()):
            if everything or self.rng.random() < 0.4:
                hold.release.set()
                del self.holds[rollout]

    def _refused(self, episode: EpisodeId, exc: CheckpointError) -> None:
        t = self.trainer
        code = str(exc.to_body()["error"]["code"])
        t.refusals.append(f"{episode.capture_key}: {code}")
        if t.attempts.get(episode.rollout_id) != episode.attempt:
            return
        if episode.capture_key in t.retired:
            return  # `retire` starts the next attempt
        if self.gym.dead:
            return  # the Gym is broken: the trainer restores it (`recover`)
        if code == "result_held":
            return  # its result waits for collect
        if code == "participant_unavailable" and episode.rollout_id in self.scenario.side:
            # Its worker died with it (a kill -9 of a worker): start it over.
            self.start(episode.rollout_id, episode.attempt + 1)
            return
        if code == "stale_attempt" and episode.capture_key in t.continuations:
            # Fenced typed (retired, or a restored attempt whose state a
            # participant lost): the trainer starts the rollout over.
            self.start(episode.rollout_id, episode.attempt + 1)
            return
        t.problems.append(f"{episode.capture_key} refused {code} ({exc.detail}) on a whole Gym")

    async def settle_runs(self, timeout_s: float = 30.0) -> None:
        tasks = list(self.trainer.running.values())
        if tasks:
            with contextlib.suppress(asyncio.CancelledError):
                async with asyncio.timeout(timeout_s):
                    await asyncio.gather(*tasks, return_exceptions=True)

    async def abandon_runs(self) -> None:
        await abandon_running(self.trainer.running)

    # --- checkpoints --------------------------------------------------------------
    def _new_dir(self) -> str:
        self.n += 1
        d = str(self.root / f"step-{self.n:04d}")
        self.attempted[d] = self.n
        return d

    async def _scope_source(self) -> list[EpisodeId]:
        # Asked while the assembler is paused: the moment the trainer saves its state.
        snap = self.trainer.snapshot()
        self._saving = snap
        return snap.scope

    def _saved(self, d: str, result: Any) -> None:
        snap = getattr(self, "_saving", None) or self.trainer.snapshot()
        self._saving = None
        self.snapshots[d] = snap
        env = [
            k for p, ks in result.episode_ids.items() if p.startswith("environment/") for k in ks
        ]
        self.captured[d] = sorted(env)

    def _arm_checkpoint_faults(self, how: str) -> list[str]:
        armed = []
        # An asynchronous checkpoint publishes late: where a slow Gym manifest
        # or LATEST of its own matters most (the next one may publish first).
        slow = 0.6 if how == "whole_async" else 0.3
        keys = [k for k in self.gym.keys if k not in self.gym.dead]
        if self.chance("write_fail"):
            k = self.rng.choice(keys)
            self.gym.fail_writes.add(k)
            armed.append(f"write_fail {k}")
        if self.chance("write_slow"):
            k = self.rng.choice(keys)
            self.gym.slow_writes.add(k)
            armed.append(f"write_slow {k}")
        if self.chance("reply_lost"):
            k = self.rng.choice(keys)
            op = self.rng.choice(["prepare", "commit", "resume"])
            self.gym.lose_replies[k] = op
            armed.append(f"reply_lost {k} {op}")
        self.gym.manifest_delay_s = (
            self.rng.uniform(0.03, 0.15) if self.chance("manifest_delay", slow) else 0.0
        )
        self.gym.latest_delay_s = (
            self.rng.uniform(0.03, 0.15) if self.chance("latest_delay", slow) else 0.0
        )
        if self.gym.manifest_delay_s:
            armed.append(f"manifest_delay {self.gym.manifest_delay_s:.3f}")
        if self.gym.latest_delay_s:
            armed.append(f"latest_delay {self.gym.latest_delay_s:.3f}")
        return armed

    def _disarm(self) -> None:
        self.gym.fail_writes.clear()
        self.gym.slow_writes.clear()
        self.gym.lose_replies.clear()

    async def checkpoint(self, how: str) -> None:
        armed = self._arm_checkpoint_faults(how)
        deadline = self.chance("deadline", 0.2) and how in ("whole_sync", "split")
        if deadline:
            armed.append("deadline")
        d = self._new_dir()
        self.log.append(f"checkpoint {how} {Path(d).name} {armed}")
        failed = await self._take(how, d, prepare_s=0.0005 if deadline else None)
        self._disarm()
        if failed is None:
            if how == "whole_async" and self.rng.random() < 0.7:
                # Overlapping: the next checkpoint opens while this one still
                # publishes (its Gym manifest or LATEST still delayed as armed).
                then = self.rng.choice(["split", "split", "whole_sync", "signal"])
                d2 = self._new_dir()
                again = await self._take(then, d2, None)
                self.log.append(f"  then {then} {Path(d2).name}: {again or 'ok'}")
            return
        self.log.append(f"  failed: {failed}")
        if self.chance("retry_dir", 0.7) and how != "drain" and not self.gym.dead:
            # The same step again, into the same directory: it must work.
            self.gym.manifest_delay_s = self.gym.latest_delay_s = 0.0
            self.attempted[d] = self.n = self.n + 1
            again = await self._take("whole_sync" if how != "split" else "split", d, None)
            self.log.append(f"  retry into {Path(d).name}: {again or 'ok'}")
            if again is not None:
                self.violations.append(f"retry of {Path(d).name} into the same directory: {again}")

    async def _take(self, how: str, d: str, prepare_s: float | None) -> str | None:
        """Take one checkpoint; None when it succeeded, else its typed error."""
        core = self.gym.core
        try:
            if how in ("whole_sync", "whole_async", "periodic"):
                durability = "async" if how == "whole_async" else "sync"
                result = await core.checkpoint(
                    d,
                    None,
                    scope_source=self._scope_source,
                    prepare_s=prepare_s,
                    durability=durability,
                    trigger="periodic" if how == "periodic" else "manual",
                )
                self._saved(d, result)
                if result.pending:
                    self.pending[result.checkpoint_id] = d
                if how == "periodic":
                    await self.gc(self.rng.randint(1, 3))
            elif how == "split":
                await core.prepare(prepare_s)
                snap = self.trainer.snapshot()
                try:
                    committed = await core.commit(d, snap.scope)
                finally:
                    await core.resume()
                self._saving = snap
                self._saved(d, committed)
            elif how == "signal":
                budget = cut_budget(10.0, 0.0)
                scope = self.trainer.scope()
                self._saving = self.trainer.snapshot()
                result = await core.checkpoint(
                    d,
                    scope,
                    prepare_s=budget.prepare_s,
                    commit_s=budget.commit_s,
                    total_s=budget.total_s,
                    trigger="signal",
                )
                self._saved(d, result)
            else:
                raise AssertionError(how)
        except CheckpointError as exc:
            self._saving = None
            return f"{type(exc).__name__}: {exc.detail[:160]}"
        return None

    async def drain(self) -> None:
        """The node of every Gym host drains: checkpoint, move, restore."""
        fail = self.chance("relaunch_fail", 0.5)
        self.relaunch_failures = 1 if fail else 0
        self.log.append(f"drain{' (relaunch fails once)' if fail else ''}")
        self.source.on = True
        before = len(self.watcher.outcomes)
        try:
            await self.watcher.poll_once()
            # A failed move is retried on later polls: run them now, not after the backoff.
            while self.watcher.retries:
                for r in self.watcher.retries:
                    r.at = 0.0
                await self.watcher.poll_once()
        finally:
            self.source.on = False
            self.watcher.handled.clear()
        for outcome in self.watcher.outcomes[before:]:
            error = outcome.error or {}
            self.log.append(
                f"  drain attempt {outcome.attempt}: ok={outcome.ok} {outcome.checkpoint_id} "
                f"{error.get('code')} {str(error.get('detail'))[:200]}"
            )
        done = [o for o in self.watcher.outcomes[before:] if o.ok]
        if done and done[-1].location is not None:
            # Moved and restored from the drain's checkpoint: the trainer continues from it.
            await self._continue_from(done[-1].location, self.coordinator_restored())

    def coordinator_restored(self) -> dict[str, list[str]]:
        actions = self.watcher.actions
        assert isinstance(actions, SimDrainActions)
        return actions.restored

    async def _relaunch(self, hosts: list[str], avoid: list[str]) -> dict[str, str]:
        if self.relaunch_failures > 0:
            self.relaunch_failures -= 1
            raise ParticipantUnavailable("injected: no room elsewhere for the drained hosts")
        await self.abandon_runs()
        await self.gym.crash_all()
        await self.gym.relaunch()
        return dict.fromkeys(hosts, "node-b")

    async def gc(self, keep: int) -> None:
        plan = await retain(str(self.root), keep)
        gone = {str(self.root / n) for n in plan.deleted_checkpoints}
        self.deleted |= gone
        self.log.append(f"gc keep {keep}: deleted {sorted(Path(g).name for g in gone)}")
        self.check_files(verify=True)

    async def durable(self) -> None:
        """The trainer waits for its asynchronous checkpoints to publish."""
        for cid in list(self.pending):
            d = self.pending.pop(cid)
            try:
                await self.gym.core.durable(cid)
                self.log.append(f"durable {Path(d).name}")
            except CheckpointError as exc:
                self.log.append(f"durable {Path(d).name} failed: {exc.detail[:120]}")

    # --- restores -------------------------------------------------------------------
    async def recover(self, *, kill_when_restored: bool = False) -> None:
        """The Gym broke: the trainer kills what is left, relaunches and restores
        the latest complete checkpoint (with its own state from the same step).

        `kill_when_restored`: a member dies between the install and the resume.
        A worker of the multi-worker server may die there too, or right after
        the resume, before the continuations' first call."""
        self.log.append("recover")
        await self.durable()
        worker_death = self.gym.sim.workers and self.chance("worker_death", 0.5)
        when = self.rng.choice(["restored", "resumed"]) if worker_death else None
        for attempt in range(4):
            await self.abandon_runs()
            await self.gym.crash_all()
            with contextlib.suppress(CheckpointError):
                await self.gym.core.resume()
            await self.gym.relaunch()
            try:
                where, episodes = await restore_target(str(self.root), None, latest=True)
            except CheckpointError as exc:
                self.log.append(f"  nothing to restore ({exc.detail[:80]}): start over")
                self.trainer.rollback(None)
                return
            if attempt == 0 and self.chance("reply_lost", 0.3):
                k = self.rng.choice(self.gym.keys)
                self.gym.lose_replies[k] = "restore"
                self.log.append(f"  reply_lost {k} restore")
            split = kill_when_restored or when == "restored"
            try:
                result = await self.gym.core.restore(where, episodes, resume=not split)
            except CheckpointError as exc:
                self._disarm()
                self.log.append(f"  restore of {Path(where).name} failed: {exc.detail[:120]}")
                continue
            if kill_when_restored:
                victim = self.rng.choice(self.gym.keys)
                self.log.append(f"  {victim} dies restored")
                await self.gym.kill(victim)
                await self.gym.core.resume()
                kill_when_restored = False
                continue
            if when == "restored":
                when = None
                await self.kill_worker(result.restored, "restored")
                try:
                    resumed = await self.gym.core.resume()
                except CoordinationFailed as exc:
                    # The restore failed whole: restore again into a fresh fleet.
                    self.log.append(f"  the restore failed at its resume: {sorted(exc.failures)}")
                    continue
                if resumed.failures:
                    self.log.append(f"  resume failures: {sorted(resumed.failures)}")
                    continue
            elif when == "resumed":
                await self.kill_worker(result.restored, "resumed")
            await self._continue_from(where, result.restored)
            return
        self.violations.append("no restore of the latest checkpoint succeeded in 4 tries")

    async def kill_worker(self, restored: dict[str, list[str]] | None, when: str) -> None:
        """One worker of the multi-worker server dies and is replaced (fresh);
        after a restore, preferably one that holds restored state."""
        side = self.gym.side
        if side is None:
            return
        pool = side.pool
        keys = (restored or {}).get(self.scenario.side_key, [])
        owners = sorted({pool.owner(EpisodeId.from_capture_key(k).rollout_id) for k in keys})
        wid = self.rng.choice(owners or [f"w{i}" for i in range(self.scenario.workers)])
        self.log.append(f"  worker {wid} dies {when} (held {keys})")
        with contextlib.suppress(KeyError):
            pool.kill(wid, respawn=True)
            self.worker_deaths += 1
        await pool.reported()

    async def _continue_from(self, where: str, restored: dict[str, list[str]]) -> None:
        t = self.trainer
        snap = self.snapshots.get(where)
        if snap is None:
            self.violations.append(f"{Path(where).name} restored, but the trainer never saved it")
            return
        await self.abandon_runs()
        t.rollback(snap)
        env = {k for p, ks in restored.items() if p.startswith("environment/") for k in ks}
        self.log.append(f"  restored {Path(where).name}: {sorted(env)}")
        for episode in snap.scope:
            nxt = episode.next()
            if nxt.capture_key in env:
                t.continuations.add(nxt.capture_key)
            self.start(episode.rollout_id, nxt.attempt)
        if self.scenario.config.completion_receipts:
            await self.collect()

    async def restore_live(self) -> None:
        """A restore aimed at the running fleet: refused up front, nothing changes."""
        try:
            where, episodes = await restore_target(str(self.root), None, latest=True)
        except CheckpointError:
            return
        self.log.append(f"restore_live {Path(where).name}")
        # A run started late (a random delay of at most 10 ms) reaches the
        # server by now: whether an episode began is then what the fleet knows.
        await asyncio.sleep(0.015)
        served = bool(self.gym.began)  # an episode began on this fleet
        try:
            result = await self.gym.core.restore(where, episodes)
        except CheckpointError as exc:
            self.log.append(f"  refused: {type(exc).__name__}")
            return
        if served:
            self.violations.append(
                f"a restore of {Path(where).name} into a serving fleet was accepted"
            )
            return
        # A fleet that served nothing yet is fresh: the restore is a restore.
        await self._continue_from(where, result.restored)

    # --- retire, receipts ---------------------------------------------------------------
    async def retire(self) -> None:
        t = self.trainer
        rollout = self.rng.choice(t.in_flight())
        episode = t.episode(rollout)
        self.log.append(f"retire {episode.capture_key}")
        t.retired.add(episode.capture_key)
        try:
            await self.gym.core.retire([episode])
        except CheckpointError as exc:
            self.log.append(f"  retire failed: {exc.detail[:120]}")
            t.problems.append(f"retire of {episode.capture_key} failed on a whole Gym: {exc!r}")
            return
        task = t.running.get(rollout)
        if task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(task), 10)
        if rollout in t.results:
            return  # it ended before the retire reached it: the result stands
        self.start(rollout, episode.attempt + 1)

    async def forget(self) -> None:
        """Drop the retire marks of rollouts whose result the trainer holds."""
        t = self.trainer
        done = sorted(
            {EpisodeId.from_capture_key(k).rollout_id for k in t.retired} & set(t.results)
        )
        if not done:
            return
        self.log.append(f"forget {done}")
        try:
            await self.gym.core.forget(done)
        except CheckpointError as exc:
            t.problems.append(f"forget of {done} failed on a whole Gym: {exc!r}")

    async def collect(self) -> None:
        try:
            got = await gym_receipts.collect(self.gym.core)
        except CheckpointError as exc:
            self.trainer.problems.append(f"collect failed on a whole Gym: {exc!r}")
            return
        for item in got.results:
            r = item.receipt.rollout_id
            self.trainer.accept(r, ("result", result_digest(item.result)), item.receipt, "collect")
        self.log.append(f"collect {len(got.results)}")

    async def ack(self) -> None:
        held = list(self.trainer.held.values())
        if not held:
            return
        self.log.append(f"ack {len(held)}")
        try:
            await gym_receipts.ack(self.gym.core, held)
        except UnknownReceipt as exc:
            # A worker that died took the results it held with it (the trainer
            # has them already): drop those receipts, ack the rest.
            lost = [r for r in held if r.rollout_id in self.scenario.side]
            if not self.worker_deaths or not lost:
                self.trainer.problems.append(f"ack of {len(held)} failed: {exc!r}")
                return
            for r in lost:
                self.trainer.held.pop(r.rollout_id, None)
            self.log.append(f"  {len(lost)} receipts lost with a worker")
            await self.ack()
            return
        except CheckpointError as exc:
            self.trainer.problems.append(f"ack of {len(held)} failed on a whole Gym: {exc!r}")
            return
        for receipt in held:
            if self.trainer.held.get(receipt.rollout_id) == receipt:
                del self.trainer.held[receipt.rollout_id]

    # --- one run ------------------------------------------------------------------------
    async def run(self) -> None:
        await self.gym.relaunch()
        try:
            for _ in range(self.scenario.n_actions):
                await self.step()
                await self.check()
                if self.violations:
                    # Broken already: what follows (a Gym left closed waits out
                    # its lease) would only slow the report of the first cause.
                    return
            await self.finish()
        finally:
            await self.abandon_runs()
            await self.gym.close()

    async def step(self) -> None:
        t, rng, gym = self.trainer, self.rng, self.gym
        pending = [r for r in self.rollouts if r not in t.started]
        if gym.dead:
            # A broken Gym: what runs unattended must refuse it; then the trainer restores.
            choice = rng.choice(["periodic", "signal", "drain", "recover", "recover"])
            if choice == "recover":
                await self.recover()
            elif choice == "drain":
                await self.drain()
            else:
                await self.checkpoint(choice)
            return
        choices = ["progress"] * 2 + list(CHECKPOINTS)
        if pending:
            choices += ["start"] * 3
        if t.in_flight():
            choices += ["retire"]
        if t.retired:
            choices += ["forget"]
        if self.scenario.config.completion_receipts:
            choices += ["ack", "collect"]
        if self.pending:
            choices += ["durable", "gc"]
        if self.has("member_death"):
            choices += ["death"]
        if self.has("restore_live") and self.snapshots:
            choices += ["restore_live"]
        if self.has("worker_death"):
            choices += ["worker_death"]
        choices += ["crash"] if self.snapshots else []
        action = rng.choice(choices)
        if action == "start":
            rollout = rng.choice(pending)
            self.log.append(f"start {rollout}")
            self.start(rollout)
        elif action == "progress":
            self.log.append("progress")
            self.release()
            await asyncio.sleep(rng.uniform(0.0, 0.02))
        elif action == "worker_death":
            await self.kill_worker(None, "idle")
        elif action == "drain":
            await self.drain()
        elif action in CHECKPOINTS:
            await self.checkpoint(action)
        elif action == "retire":
            await self.retire()
        elif action == "forget":
            await self.forget()
        elif action == "ack":
            await self.ack()
        elif action == "collect":
            await self.collect()
        elif action == "durable":
            await self.durable()
        elif action == "gc":
            await self.gc(rng.randint(1, 3))
        elif action == "death":
            await self.death()
        elif action == "restore_live":
            await self.restore_live()
        elif action == "crash":
            await self.recover(kill_when_restored=self.chance("member_death", 0.3))

    async def death(self) -> None:
        """A member dies: while idle, inside a checkpoint, or while writing."""
        gym, rng = self.gym, self.rng
        victim = rng.choice(gym.keys)
        when = rng.choice(["idle", "prepared", "committed", "writing"])
        self.log.append(f"death {victim} {when}")
        if when == "idle":
            await gym.kill(victim)
            return
        if when == "writing":
            d = self._new_dir()
            gym.slow_writes.update(gym.keys)
            with contextlib.suppress(CheckpointError):
                result = await gym.core.checkpoint(
                    d, None, scope_source=self._scope_source, durability="async"
                )
                self._saved(d, result)
                self.pending[result.checkpoint_id] = d
            await gym.kill(victim)
            self._disarm()
            await self.durable()
            return
        d = self._new_dir()
        try:
            await gym.core.prepare()
            snap = self.trainer.snapshot()
            if when == "prepared":
                await gym.kill(victim)
            committed = await gym.core.commit(d, snap.scope)
            self._saving = snap
            self._saved(d, committed)
            if when == "committed":
                await gym.kill(victim)
        except CheckpointError as exc:
            self.log.append(f"  {type(exc).__name__}")
        finally:
            await gym.core.resume()

    async def finish(self) -> None:
        """Repair, run everything to its end, and check the end state."""
        await self.durable()
        if self.gym.dead:
            await self.recover()
        t = self.trainer
        for rollout in self.rollouts:
            if rollout not in t.started:
                self.start(rollout)
        for _ in range(20):
            self.release(everything=True)
            await self.settle_runs()
            if self.scenario.config.completion_receipts:
                await self.collect()
            # Rollouts whose run was refused typed and restarted run again.
            if not [r for r in t.running.values() if not r.done()]:
                break
        await self.check()
        missing = sorted(r for r in self.rollouts if r not in t.results)
        if missing:
            self.violations.append(f"rollouts with no result at the end: {missing}")
        for rollout, outcome in sorted(t.results.items()):
            if outcome != self.expected[rollout]:
                self.violations.append(
                    f"{rollout}: {outcome} != uninterrupted {self.expected[rollout]}"
                )
        for key in sorted(t.continuations):
            began = self.gym.began.get(key)
            if began is False:
                self.violations.append(f"{key} was restored, but its run began from scratch")
        self.check_files(verify=True)
        await self.latest_restores()

    async def latest_restores(self) -> None:
        """The latest checkpoint restores, into a fresh fleet, exactly what it captured."""
        try:
            where, episodes = await restore_target(str(self.root), None, latest=True)
        except CheckpointError:
            return
        if where not in self.captured:
            return  # taken by a drain the trainer learnt of through its restore
        fresh = SimGym(self.scenario)
        try:
            await fresh.relaunch()
            result = await fresh.core.restore(where, episodes)
        except CheckpointError as exc:
            self.violations.append(f"latest {Path(where).name} does not restore: {exc!r}")
            return
        finally:
            await fresh.close()
        env = sorted(
            k for p, ks in result.restored.items() if p.startswith("environment/") for k in ks
        )
        want = sorted(
            EpisodeId.from_capture_key(k).next().capture_key for k in self.captured[where]
        )
        if env != want:
            self.violations.append(f"{Path(where).name} restored {env}, it captured {want}")

    # --- invariants -------------------------------------------------------------------
    async def check(self) -> None:
        gym = self.gym
        if gym.core.open is not None:
            self.violations.append(f"a checkpoint is left open: {gym.core.open.checkpoint_id}")
        for key, ctrl in gym.engines().items():
            phase = ctrl.state.phase.value
            if phase != "idle":
                self.violations.append(f"{key} left {phase} (admission closed)")
        self.violations += [f"probe: {v}" for v in gym.violations]
        gym.violations.clear()
        self.violations += self.trainer.problems
        self.trainer.problems.clear()
        if not gym.core.pending.running():
            self.check_latest()
        self.check_files()

    def complete(self) -> dict[str, str]:
        """Every directory with a Gym manifest: dir -> checkpoint ID."""
        out = {}
        for d in sorted(self.attempted):
            with contextlib.suppress(CheckpointError):
                out[d] = read_gym_manifest(open_location(d)).checkpoint_id
        return out

    def check_latest(self) -> None:
        complete = self.complete()
        pointer = read_latest(open_location(str(self.root)))
        if not complete:
            return
        newest = max(complete, key=lambda d: self.attempted[d])
        named = None if pointer is None else str(self.root / pointer.name)
        if named != newest:
            self.violations.append(
                f"LATEST names {named and Path(named).name}, the newest complete "
                f"checkpoint is {Path(newest).name}"
            )

    def check_files(self, *, verify: bool = False) -> None:
        want = set(self.gym.keys)
        for d in self.complete():
            listed = {
                f"{e.kind}/{e.instance}" for e in read_gym_manifest(open_location(d)).participants
            }
            if listed != want:
                self.violations.append(
                    f"{Path(d).name} is complete with {sorted(listed)}, the Gym is {sorted(want)}"
                )
            if verify:
                report = verify_checkpoint(d)
                if not report.ok:
                    self.violations.append(f"{Path(d).name} does not verify: {report.errors}")


KINDS = KIND_ORDER
