"""Helpers of the NeMo-Gym-parity cases: one engine view over two backends.

A `Gym` is a reference fleet plus the real coordination logic driving it:

- `LocalGym`: the fleet in this event loop (`participants.local`) behind a
  `CoordinatorCore` whose hosts wrap the servers' own engines — no Ray,
  real files, real loopback HTTP.  A crash drops the driver's calls, marks the
  hosts dead and stops every server without draining (in-flight handlers are
  cancelled; nothing resumes), so the next fleet is fresh.
- `RayGym`: `ParticipantHost` actors and a coordinator actor on the shared
  cluster (part A's `e2e` kit); a crash `ray.kill`s every host.

Both keep the `/stats` of every fleet they crashed (`history`), so a test can
count the work a crash made it redo (`work`, `lost_work_rows`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from coordination.client.handle import CoordinatorHandle
from coordination.demo.scenario import Rollouts, crash
from coordination.engine.coordinator_core import CoordinatorCore
from coordination.engine.order import Member
from coordination.engine.results import (
    CommitResult,
    CoordinatorStatus,
    ForgetResult,
    PrepareResult,
    RestoreResult,
    ResumeResult,
    Timeouts,
)
from coordination.reach.hosts import FakeHost
from participants.fleet import KIND_ORDER, START_ORDER, Fleet, FleetConfig, factory_options
from participants.local import LocalFleet, start_local_server
from participants.model_calls import Call
from ray_ckpt.control.client import data_session
from ray_ckpt.identity import EpisodeId
from tests.e2e.conftest import E2E, Stats, reads_until, until

# Small and quick: a turn is ~0.1 s, so a checkpoint lands mid-generation or mid-tool.
FAST = FleetConfig(
    token="parity-token",
    step_delay_s=0.03,
    token_delay_s=0.01,
    tokens_per_turn=6,
    turns_per_step=2,
    suffix="p",
)
LOCAL_TIMEOUTS = Timeouts(
    prepare_s=20.0,
    commit_s=20.0,
    resume_s=10.0,
    restore_s=20.0,
    retire_s=20.0,
    status_s=5.0,
    pause_s=5.0,
    renew_every_s=3600.0,
    reply_grace_s=0.5,
    cleanup_min_s=5.0,
)


async def server_stats(urls: dict[str, str]) -> Stats:
    out: Stats = {}
    async with data_session(16, 16) as session:
        for kind, url in urls.items():
            async with session.get(url.rstrip("/") + "/stats") as resp:
                out[kind] = await resp.json()
    return out


class TokenLog:
    """Model tokens generated and calls admitted per rollout, across local fleets.

    Wraps each model participant's `drop`, which every admitted call passes
    through exactly once when it leaves (delivered, cancelled or crashed).
    """

    def __init__(self) -> None:
        self.generated: Counter[str] = Counter()
        self.continued: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def attach(self, model_server: Any) -> None:
        part = model_server.participant
        original: Callable[[Call], None] = part.drop

        def drop(call: Call) -> None:
            if call.index in part.calls:
                rollout = call.episode.rollout_id
                self.generated[rollout] += len(call.tokens) - call.continued
                self.continued[rollout] += call.continued
                self.calls[rollout] += 1
            original(call)

        part.drop = drop


class Gym:
    """What a test drives: the current fleet, its coordinator, the fleets it crashed."""

    backend = "?"

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.history: list[Stats] = []  # /stats of each crashed fleet

    @property
    def urls(self) -> dict[str, str]:
        raise NotImplementedError

    @property
    def env_url(self) -> str:
        return self.urls["environment"]

    async def stats(self) -> Stats:
        return await server_stats(self.urls)

    async def prepare(self) -> PrepareResult:
        raise NotImplementedError

    async def commit(self, checkpoint_dir: str, scope: Sequence[EpisodeId]) -> CommitResult:
        raise NotImplementedError

    async def resume(self) -> ResumeResult:
        raise NotImplementedError

    async def restore(self, checkpoint_dir: str, scope: Sequence[EpisodeId]) -> RestoreResult:
        raise NotImplementedError

    async def retire(self, episodes: Sequence[EpisodeId]) -> None:
        raise NotImplementedError

    async def forget(self, rollouts: Sequence[str]) -> ForgetResult:
        raise NotImplementedError

    async def status(self) -> CoordinatorStatus:
        raise NotImplementedError

    async def crash(self, rollouts: Rollouts) -> None:
        raise NotImplementedError

    async def relaunch(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class LocalGym(Gym):
    backend = "local"

    def __init__(self, config: FleetConfig) -> None:
        super().__init__(config)
        self.core = CoordinatorCore(timeouts=LOCAL_TIMEOUTS)
        self.tokens = TokenLog()
        self.fleet: LocalFleet | None = None
        self.hosts: list[FakeHost] = []
        self.fleets: list[LocalFleet] = []

    @classmethod
    async def start(cls, config: FleetConfig) -> LocalGym:
        gym = cls(config)
        await gym.relaunch()
        return gym

    @property
    def urls(self) -> dict[str, str]:
        assert self.fleet is not None, "no fleet is running"
        return self.fleet.urls

    def server(self, kind: str) -> Any:
        assert self.fleet is not None
        return self.fleet.server(kind)

    async def relaunch(self) -> None:
        fleet = LocalFleet()
        self.fleets.append(fleet)
        for kind in START_ORDER:
            factory, options = factory_options(kind, self.config, fleet.urls)
            # Almost no drain: a crash cancels in-flight handlers at once, as a kill
            # would (aiohttp reads a zero shutdown timeout as "wait forever").
            fleet.servers[kind] = await start_local_server(
                kind, factory, self.config.server_name(kind), self.config, drain_s=0.01, **options
            )
        self.tokens.attach(fleet.server("model"))
        self.hosts = []
        for kind, engine in fleet.engines.items():
            host = FakeHost(Member(kind, self.config.server_name(kind)), engine)
            self.hosts.append(host)
            self.core.register(host)
        self.fleet = fleet

    async def crash(self, rollouts: Rollouts) -> None:
        # The driver's calls die with the fleet (abandoned first, so none of
        # them reports the crash as an episode failure).
        await rollouts.abandon()
        for host in self.hosts:
            host.dead = True
        fleet, self.fleet = self.fleet, None
        assert fleet is not None
        await fleet.stop()
        model = fleet.server("model").participant

        async def dropped() -> bool:
            return not model.calls

        # Cancelled handlers finish their `finally:` on the next loop turns.
        await until(dropped, "the cancelled model calls to drop", timeout_s=5, poll_s=0.005)
        self.history.append({k: fleet.server(k).stats() for k in KIND_ORDER})

    async def prepare(self) -> PrepareResult:
        return await self.core.prepare()

    async def commit(self, checkpoint_dir: str, scope: Sequence[EpisodeId]) -> CommitResult:
        return await self.core.commit(checkpoint_dir, list(scope))

    async def resume(self) -> ResumeResult:
        return await self.core.resume()

    async def restore(self, checkpoint_dir: str, scope: Sequence[EpisodeId]) -> RestoreResult:
        return await self.core.restore(checkpoint_dir, list(scope))

    async def retire(self, episodes: Sequence[EpisodeId]) -> None:
        await self.core.retire(list(episodes))

    async def forget(self, rollouts: Sequence[str]) -> ForgetResult:
        return await self.core.forget(list(rollouts))

    async def status(self) -> CoordinatorStatus:
        return await self.core.status()

    async def close(self) -> None:
        for fleet in self.fleets:
            await fleet.stop()
        await self.core.aclose()


class RayGym(Gym):
    """Hosts and coordinator from part A's `e2e` kit, which kills both at teardown."""

    backend = "ray"

    def __init__(self, config: FleetConfig, kit: E2E) -> None:
        super().__init__(config)
        self.kit = kit
        self.handle: CoordinatorHandle = kit.coordinator(name="parity-coordinator")
        self.fleet: Fleet | None = None

    @classmethod
    async def start(cls, config: FleetConfig, kit: E2E) -> RayGym:
        gym = cls(config, kit)
        await gym.relaunch()
        return gym

    @property
    def urls(self) -> dict[str, str]:
        assert self.fleet is not None, "no fleet is running"
        return self.fleet.urls

    async def relaunch(self) -> None:
        self.fleet = await self.kit.launch(self.config)

    async def crash(self, rollouts: Rollouts) -> None:
        fleet, self.fleet = self.fleet, None
        assert fleet is not None
        # Counters die with the processes: read them just before the kill.
        self.history.append(await server_stats(fleet.urls))
        await crash(fleet, rollouts)

    async def prepare(self) -> PrepareResult:
        return await self.handle.aprepare()

    async def commit(self, checkpoint_dir: str, scope: Sequence[EpisodeId]) -> CommitResult:
        return await self.handle.acommit(checkpoint_dir, list(scope))

    async def resume(self) -> ResumeResult:
        return await self.handle.aresume()

    async def restore(self, checkpoint_dir: str, scope: Sequence[EpisodeId]) -> RestoreResult:
        return await self.handle.arestore(checkpoint_dir, list(scope))

    async def retire(self, episodes: Sequence[EpisodeId]) -> None:
        for e in episodes:
            await self.handle.aretire(e.rollout_id, e.attempt)

    async def forget(self, rollouts: Sequence[str]) -> ForgetResult:
        return await self.handle.aforget(list(rollouts))

    async def status(self) -> CoordinatorStatus:
        return await self.handle.astatus()

    async def close(self) -> None:
        if self.fleet is not None:
            with contextlib.suppress(Exception):
                await self.fleet.stop(timeout_s=10)


async def start_gym(config: FleetConfig, kit: E2E | None) -> Gym:
    """A Ray gym in the kit's namespace when there is a kit, else one in process."""
    if kit is not None:
        return await RayGym.start(replace(config, namespace=kit.namespace), kit)
    return await LocalGym.start(config)


async def crash_restore(
    gym: Gym, rollouts: Rollouts, where: str, scope: Sequence[EpisodeId]
) -> RestoreResult:
    """Kill the fleet with the checkpoint still open, resume what survives (the
    coordinator's open checkpoint; dead hosts fail), restore into fresh hosts."""
    await gym.crash(rollouts)
    resumed = await gym.resume()
    assert resumed.failures, "every host was dead: resume should report them"
    await gym.relaunch()
    return await gym.restore(where, scope)


# --- end state ---------------------------------------------------------------


def holdings(stats: Stats) -> dict[str, int]:
    """Everything a server still holds for some episode (all zero when empty)."""
    env, model, agent, res = (stats[k] for k in KIND_ORDER)
    return {
        "env_live": env["live_episodes"],
        "env_restored": env["restored_episodes"],
        "model_live_calls": model["live_calls"],
        "model_ledgers": model["ledgers"],
        "model_cuts": model["cuts"],
        "model_restored_cuts": model["restored_cuts"],
        "agent_sessions": agent["sessions"],
        "agent_live": agent["live_activations"],
        "res_sessions": res["sessions"],
        "res_tracked": res["tracked_sessions"],
        "res_inflight": res["inflight"],
    }


async def assert_idle_and_empty(gym: Gym, *, retired_rollouts: int = 0) -> None:
    """Every participant idle with nothing live and `retired_rollouts` marks; every
    server holding no episode, session, in-flight call, cut or ledger."""
    status = await gym.status()
    rows = {p.participant: p for p in status.participants}
    assert status.open_checkpoint is None
    assert len(rows) == len(KIND_ORDER), sorted(rows)
    for key, row in rows.items():
        assert row.error is None, (key, row.error)
        got = (row.phase, row.live_executions, row.retired_rollouts)
        assert got == ("idle", 0, retired_rollouts), (key, got)
    held = holdings(await gym.stats())
    assert held == dict.fromkeys(held, 0), held


# --- lost work -----------------------------------------------------------------


def work(stats: Stats) -> dict[str, int]:
    """The work one fleet did, from its `/stats`."""
    agent = stats["agent"]
    return {
        "tokens": int(stats["model"]["tokens_generated"]),
        "continued": int(stats["model"]["tokens_continued"]),
        "turns": int(agent["model_calls"]) - int(agent["model_refusals"]),
        "tools": int(agent["tool_calls"]),
        "verifications": int(stats["resources"]["verifications"]),
    }


def summed(rows: Sequence[dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for row in rows:
        total.update(row)
    return {k: total[k] for k in ("tokens", "continued", "turns", "tools", "verifications")}


def expected_work(config: FleetConfig, steps: Sequence[int]) -> dict[str, int]:
    """What an uninterrupted run of episodes of these lengths does."""
    turns = sum(steps) * config.turns_per_step
    return {
        "tokens": turns * config.tokens_per_turn,
        "continued": 0,
        "turns": turns,
        "tools": turns,
        "verifications": len(steps),
    }


def redone(done: dict[str, int], baseline: dict[str, int]) -> dict[str, int]:
    return {k: done[k] - baseline[k] for k in ("tokens", "turns", "tools", "verifications")}


def table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in header], *[[_fmt(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    rule = "-" * len(lines[0])
    return "\n".join(["", title, rule, lines[0], rule, *lines[1:], rule])


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def replace(config: FleetConfig, **changes: Any) -> FleetConfig:
    return msgspec.structs.replace(config, **changes)


# --- driving -------------------------------------------------------------------


async def stats_until(
    gym: Gym, predicate: Callable[[Stats], bool], what: str, *, timeout_s: float = 20.0
) -> Stats:
    """Poll every server's `/stats` until `predicate` holds; fail naming `what`."""
    return await reads_until(gym.stats, predicate, what, timeout_s=timeout_s, poll_s=0.005)


def generating(stats: Stats, *, below: int) -> bool:
    """Some generation is past its first token and short of `below` tokens."""
    return any(1 <= n < below for n in stats["model"]["in_flight_tokens"])


def tool_in_flight(stats: Stats) -> bool:
    routes = stats["resources"]["inflight_by_route"]
    return bool(routes.get("guess") or routes.get("hint"))


def env_keys(result: Any) -> list[str]:
    """The capture keys the environment participant restored or exported."""
    table = getattr(result, "restored", None)
    if table is None:
        table = result.episode_ids
    return sorted(k for p, keys in table.items() if p.startswith("environment/") for k in keys)


def publish(request: Any, name: str, text: str) -> None:
    """Show `text` in the terminal even without `-s` (CI logs) and in the junit XML."""
    request.node.user_properties.append((name, text))
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
        print(text, flush=True)
