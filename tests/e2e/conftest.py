"""Fixtures of the process-level end-to-end suite (real hosts on the shared Ray).

For every e2e module (part B may use them too):

- `e2e` (function scope) → `E2E`, a kit bound to the test's Ray namespace and
  `tmp_path` that stops what it started when the test ends:
  - `e2e.config(**overrides) -> FleetConfig`: small, fast reference fleet;
  - `await e2e.launch(config) -> Fleet`: `ParticipantHost` actors, killed at teardown;
  - `e2e.coordinator(name=..., **timeouts) -> CoordinatorHandle`: a coordinator
    with its journal under `tmp_path`, killed at teardown;
  - `await e2e.baseline(config, n, steps, seed) -> {rollout: digest}`: the
    uninterrupted run's digests (`baseline` below, for `Rollouts.make(n, steps, seed)`);
  - `e2e.rollouts(n, steps, seed) -> (Rollouts, Tally)`: a tally counts each
    rollout's finishes, so a test can assert each finished exactly once.
- `await baseline(config, tasks) -> {rollout: digest}`: the uninterrupted run's
  digests, computed in process without Ray (delays zeroed, checkpointing off:
  results are seed-deterministic) and cached per session.
- `await until(probe, what, timeout_s=...)`: poll a condition, fail with `what`.
- `await reads_until(read, predicate, what)`: poll `read()` until `predicate` holds.
- `await stats_until(fleet, predicate, what)`: poll every server's `/stats`.
- `await host_phases(fleet)`, `await assert_clean(fleet)`: control phase per
  kind; every server idle and holding nothing.
- `assert_exactly_once(rollouts, tally, expected)`: digests equal, nothing
  lost, nothing finished twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import orjson
import pytest

from coordination.client.connect import connect
from coordination.client.handle import CoordinatorHandle
from coordination.demo.scenario import Rollouts, fleet_stats
from participants.fleet import Fleet, FleetConfig, launch_fleet
from participants.local import start_local_fleet
from ray_ckpt.control.client import data_session

T = TypeVar("T")

Stats = dict[str, dict[str, Any]]

# Results depend on these config fields only (never on delays, names or modes
# that decide what a checkpoint waits for).
_RESULT_FIELDS = ("model_seed", "tokens_per_turn", "turns_per_step", "resources_mode")
_baselines: dict[bytes, dict[str, str]] = {}


async def baseline(config: FleetConfig, tasks: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Digests of an uninterrupted run of `tasks` with checkpointing off, in process
    (delays zeroed: results depend on the seeds only), cached per session."""
    key = orjson.dumps(
        [*(getattr(config, f) for f in _RESULT_FIELDS), tasks], option=orjson.OPT_SORT_KEYS
    )
    if key not in _baselines:
        quick = msgspec.structs.replace(
            config, checkpoint=False, token_delay_s=0.0, step_delay_s=0.0, verify_delay_s=0.0
        )
        fleet = await start_local_fleet(quick)
        rollouts = Rollouts(dict(tasks))
        try:
            async with data_session(64, 64) as session:
                for rollout in rollouts.tasks:
                    rollouts.start(session, fleet.urls["environment"], rollout)
                await rollouts.wait(timeout_s=60)
        finally:
            await fleet.stop()
        assert not rollouts.failures, rollouts.failures
        _baselines[key] = rollouts.digests()
    return dict(_baselines[key])


class Tally:
    """Finishes per rollout and the attempt each finished as."""

    def __init__(self, rollouts: Rollouts) -> None:
        self.rollouts = rollouts
        self.finished: Counter[str] = Counter()
        self.attempt: dict[str, int] = {}
        rollouts.on_event = self.on_event

    def on_event(self, event: str, rollout: str) -> None:
        if event == "finished":
            self.finished[rollout] += 1
            self.attempt[rollout] = self.rollouts.attempts.get(rollout, 0)


class E2E:
    def __init__(self, namespace: str, tmp: Path) -> None:
        self.namespace = namespace
        self.tmp = tmp
        self.fleets: list[Fleet] = []
        self.coordinators: list[CoordinatorHandle] = []
        self.drivers: list[Rollouts] = []

    def config(self, **overrides: Any) -> FleetConfig:
        base: dict[str, Any] = {
            "namespace": self.namespace,
            "token": "e2e-token",
            "token_delay_s": 0.02,
            "tokens_per_turn": 6,
            "turns_per_step": 2,
            "step_delay_s": 0.08,
            "verify_delay_s": 0.3,
            "suffix": "e2e",
        }
        return FleetConfig(**{**base, **overrides})

    async def launch(self, config: FleetConfig) -> Fleet:
        fleet = await launch_fleet(config)
        self.fleets.append(fleet)
        return fleet

    def coordinator(
        self, *, name: str = "e2e-coordinator", state: str | None = None, **timeouts: float
    ) -> CoordinatorHandle:
        handle = connect(
            namespace=self.namespace,
            name=name,
            state_dir=str(self.tmp / "coordinator" / (state or name)),
            timeouts={"reply_grace_s": 0.5, **timeouts},
        )
        self.coordinators.append(handle)
        return handle

    def rollouts(self, n: int, steps: int, seed: int) -> tuple[Rollouts, Tally]:
        rollouts = Rollouts.make(n, steps, seed)
        self.drivers.append(rollouts)
        return rollouts, Tally(rollouts)

    async def baseline(self, config: FleetConfig, n: int, steps: int, seed: int) -> dict[str, str]:
        return await baseline(config, Rollouts.make(n, steps, seed).tasks)

    def close(self) -> None:
        import ray

        # A failed test may leave /run calls behind; the loop's shutdown reaps them.
        for rollouts in self.drivers:
            for task in rollouts.running.values():
                task.cancel()
        for fleet in self.fleets:
            with contextlib.suppress(Exception):
                fleet.kill()
        for handle in self.coordinators:
            with contextlib.suppress(Exception):
                ray.kill(handle.actor, no_restart=True)


@pytest.fixture
def e2e(namespace: str, tmp_path: Path) -> Iterator[E2E]:
    # Synchronous on purpose: async fixtures may take it with getfixturevalue.
    kit = E2E(namespace, tmp_path)
    try:
        yield kit
    finally:
        kit.close()


async def until(
    probe: Callable[[], Awaitable[T]], what: str, *, timeout_s: float = 20.0, poll_s: float = 0.02
) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    last: T = await probe()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last: {last!r}")
        await asyncio.sleep(poll_s)
        last = await probe()
    return last


async def reads_until(
    read: Callable[[], Awaitable[T]],
    predicate: Callable[[T], bool],
    what: str,
    *,
    timeout_s: float = 20.0,
    poll_s: float = 0.02,
) -> T:
    """`read()` polled until `predicate` holds of it; fail naming `what` and the last read."""
    seen: list[T] = []

    async def probe() -> bool:
        seen[:] = [await read()]
        return predicate(seen[0])

    try:
        await until(probe, what, timeout_s=timeout_s, poll_s=poll_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; stats: {seen}") from None
    return seen[0]


async def stats_until(
    fleet: Fleet, predicate: Callable[[Stats], bool], what: str, *, timeout_s: float = 20.0
) -> Stats:
    """Every server's `/stats`, polled until `predicate` holds."""
    return await reads_until(lambda: fleet_stats(fleet), predicate, what, timeout_s=timeout_s)


async def host_phases(fleet: Fleet) -> dict[str, str]:
    """Each host's control phase, by kind."""
    out: dict[str, str] = {}
    for kind, host in fleet.ordered():
        out[kind] = (await host.status.remote())["phase"]
    return out


def held(stats: dict[str, dict[str, Any]]) -> dict[str, int]:
    """What the servers still hold for episodes (all zero when clean)."""
    env, model = stats["environment"], stats["model"]
    return {
        "env_live": env["live_episodes"],
        "env_restored": env["restored_episodes"],
        "model_live_calls": model["live_calls"],
        "model_restored_cuts": model["restored_cuts"],
        "agent_sessions": stats["agent"]["sessions"],
        "resources_sessions": stats["resources"]["sessions"],
        "resources_inflight": stats["resources"]["inflight"],
    }


async def assert_clean(fleet: Fleet) -> None:
    """Every host idle; no server holds a live, restored or session state."""
    assert set((await host_phases(fleet)).values()) == {"idle"}
    stats = await fleet_stats(fleet)
    assert held(stats) == dict.fromkeys(held(stats), 0), held(stats)


def assert_exactly_once(rollouts: Rollouts, tally: Tally, expected: dict[str, str]) -> None:
    """Every rollout finished once, as some attempt, with the uninterrupted result."""
    assert not rollouts.running or all(t.done() for t in rollouts.running.values())
    assert sorted(rollouts.results) == sorted(expected), (
        f"lost: {sorted(set(expected) - set(rollouts.results))}; failures {rollouts.failures}"
    )
    assert dict(tally.finished) == dict.fromkeys(expected, 1), f"finishes: {dict(tally.finished)}"
    assert rollouts.digests() == expected
