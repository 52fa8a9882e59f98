"""The crash matrix: a real kill at each point of a checkpoint's life, of each
participant kind and of the coordinator, in each step mode.

Kill points, and what is restored afterwards:

- `mid_prepare`: the coordinator's prepare is under way and a host waits
  behind an in-flight step (wait mode: a waited verify holds the environment;
  replay mode, where the verify would replay: a tool call, a wait step of the
  agent, holds the agent).  Restores an
  earlier whole checkpoint `c1`, taken first for that purpose.
- `prepared`: every host prepared, nothing committed.  Restores `c1`.
- `mid_commit`: the target's records file is being written (a stalling store
  on that host holds the write with the temporary records file open).
  Restores `c1`; the torn `c2` is refused as a whole.
- `committed`: committed, before resume.  Restores that checkpoint.
- `after_resume`: resumed, and work went on past the checkpoint.  Restores it
  (the work after it is lost and done again).
- `mid_restore`: a fresh fleet is installing a whole checkpoint, every host
  installed but one whose stalling store holds its read.  A third fleet
  restores the same checkpoint.

A host target is killed with `ray.kill(host, no_restart=True)`; the rest of
its fleet then crashes too (`crash`: a restore needs fresh processes
everywhere), a fresh fleet under the same names restores and every
unfinished rollout goes on as attempt 1.  The coordinator is killed the same
way; its fleet lives on, each lease lapses and the participant resumes by
itself, rollouts carry on as attempt 0, and a successor under the same name
and journal recovers (for `mid_restore` the half-restored fleet is replaced
and the successor restores into a fresh one).

Every cell asserts that every rollout finished exactly once with the
uninterrupted run's result, and that each unfinished rollout either went on
from the restored checkpoint (exactly those the checkpoint holds a boundary
of) or was restarted, exactly once (attempt 1).

Checkpoints are taken only once every rollout is past its seed step: an
episode cut between `/run`'s `begin` and its first boundary is exported with
boundary `None` (the environment server begins it without one), and its
continuation is then refused with "the episode was restored for a different
task" (`participants/environment.py`, `expect_task`).  That is a product bug,
timing-dependent here, reported rather than left to flake the matrix.

A cell costs two or three fleet launches (about a second of CPU per host), so
the default run is every kill point x every target with the step mode
alternating (each kill point and each target meets both modes): 30 cells.
`RAY_CKPT_CRASH_MATRIX=full` runs all 60.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp
import pytest
import ray

import participants.fleet as fleet_module
from coordination.client.handle import CoordinatorHandle
from coordination.demo.scenario import Rollouts, crash, fleet_stats, restore_and_continue
from participants.fleet import Fleet, FleetConfig
from ray_ckpt.control.client import data_session
from ray_ckpt.errors import CoordinationFailed, ParticipantUnavailable
from ray_ckpt.gym_server.spec import import_factory
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage import load_manifest, verify_checkpoint
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.seam import FileRecordStore
from tests.e2e.conftest import (
    E2E,
    assert_clean,
    assert_exactly_once,
    host_phases,
    reads_until,
    stats_until,
    until,
)
from tests.e2e.test_coordinator_crash import mid_flight, phases
from tests.e2e.test_crash_uncommitted import assert_untouched, checkpoint

pytestmark = [pytest.mark.ray, pytest.mark.slow]

N, STEPS, SEED = 3, 2, 61
KILLS = ("mid_prepare", "prepared", "mid_commit", "committed", "after_resume", "mid_restore")
TARGETS = ("environment", "model", "agent", "resources", "coordinator")
MODES = ("wait", "replay")

# Coordinator cells: short deadlines and leases, so a dead coordinator's
# checkpoint lapses in seconds (a lease runs to the call's deadline + grace).
LEASE_S = 1.0
PREPARE_S, COMMIT_S, RESTORE_S = 2.0, 3.0, 3.0
# An open checkpoint's renewer extends every lease to now + resume_s: keep it
# short too, or a coordinator dead after a commit leaves leases of ~30 s.
RESUME_S = 2.0
# The host whose write/read stalls when the coordinator is the target.
STALLED_FOR_COORDINATOR = "model"
# A stalled host waits for the cell's gate file at most this long (a cell that
# failed before opening it never leaves a host stuck for good).
GATE_MAX_S = 60.0


# --- fault injection: a records store that stalls ---------------------------------


class StallingStore:
    """The host's own record store, with its writes into `<dir>` (by name) held
    with the temporary records file open, and its reads held before they start,
    until the cell opens the gate: a kill meanwhile is a kill mid-commit or
    mid-restore, whatever the machine's load."""

    def __init__(self, inner: Any, *, gate: str, write_dir: str, read: bool) -> None:
        self.inner = inner
        self.gate = gate
        self.write_dir = write_dir
        self.hold_reads = read

    def new_stop(self) -> Any:
        return self.inner.new_stop()

    def write(self, checkpoint_dir: str, *, records: Sequence[Record], **kw: Any) -> Any:
        if Path(checkpoint_dir).name == self.write_dir:
            records = _held(records, self.gate)  # type: ignore[assignment]
        return self.inner.write(checkpoint_dir, records=records, **kw)

    def read(self, checkpoint_dir: str, **kw: Any) -> Any:
        if self.hold_reads:
            _wait_for(self.gate)
        return self.inner.read(checkpoint_dir, **kw)


def _wait_for(gate: str) -> None:
    """Block this (store) thread until the gate file exists (bounded)."""
    deadline = time.monotonic() + GATE_MAX_S
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)


def _held(records: Iterable[Record], gate: str) -> Iterator[Record]:
    # The encoder pulls the first record with the temporary file already open.
    _wait_for(gate)
    yield from records


def stalling_server(
    *,
    stall_inner: str,
    stall_gate: str,
    stall_write_dir: str = "",
    stall_read: bool = False,
    **options: Any,
) -> Any:
    """A reference server whose engine gets a `StallingStore` (the store is a
    public attribute of the engine, meant to be replaceable)."""
    server = import_factory(stall_inner)(**options)
    attach = server.attach

    def attach_stalling(engine: Any) -> None:
        attach(engine)
        # Every write in full: an incremental one decides what changed before
        # its records file opens, and the hold must find that file open.
        engine.store = StallingStore(
            FileRecordStore(full_every=1),
            gate=stall_gate,
            write_dir=stall_write_dir,
            read=stall_read,
        )

    server.attach = attach_stalling
    return server


@contextlib.contextmanager
def stalls(kind: str | None, **stall: Any) -> Iterator[None]:
    """While in effect, `launch_fleet` builds the `kind` host by `stalling_server`."""
    if kind is None:
        yield
        return
    plain = fleet_module.factory_options

    def options(k: str, config: FleetConfig, urls: dict[str, str]) -> tuple[str, dict[str, Any]]:
        factory, opts = plain(k, config, urls)
        if k != kind:
            return factory, opts
        extra = {f"stall_{key}": value for key, value in stall.items()}
        return f"{__name__}:stalling_server", {**opts, "stall_inner": factory, **extra}

    with mock.patch.object(fleet_module, "factory_options", options):
        yield


# --- one cell ---------------------------------------------------------------------


@dataclass
class Cell:
    e2e: E2E
    kill: str
    target: str
    mode: str
    gym: CoordinatorHandle
    rollouts: Rollouts
    session: aiohttp.ClientSession
    config: FleetConfig
    fleet: Fleet

    @property
    def c1(self) -> str:
        return str(self.e2e.tmp / "c1")

    @property
    def c2(self) -> str:
        return str(self.e2e.tmp / "c2")

    @property
    def gate(self) -> str:
        """Opened (created) to let a stalled store go on."""
        return str(self.e2e.tmp / "gate")

    def open_gate(self) -> None:
        Path(self.gate).touch()

    async def fresh(self, stalled: str | None = None, **stall: Any) -> Fleet:
        """A fresh fleet under the same names (the dead ones' names released)."""
        with stalls(stalled, **stall):
            return await self.e2e.launch(self.config)

    def kill_target(self, fleet: Fleet | None = None) -> None:
        if self.target == "coordinator":
            ray.kill(self.gym.actor, no_restart=True)
        else:
            ray.kill((fleet or self.fleet).hosts[self.target], no_restart=True)

    def target_name(self, fleet: Fleet | None = None) -> str:
        return (fleet or self.fleet).names[self.target]

    async def progress(self) -> None:
        """Work goes on past the last checkpoint (and some of it is still unfinished)."""
        tokens = (await fleet_stats(self.fleet))["model"]["tokens_generated"]
        await stats_until(
            self.fleet,
            lambda s: s["model"]["tokens_generated"] >= tokens + 12 and mid_flight(s),
            "progress after the checkpoint, rollouts still in flight",
        )


def under_way(stats: dict[str, dict[str, Any]]) -> bool:
    """Every rollout started and seeded, some generating: no checkpoint of the
    cell cuts an episode before its first boundary (see the module docstring)."""
    return stats["environment"].get("seeds", 0) >= N and mid_flight(stats)


def coordinator(e2e: E2E, target: str) -> CoordinatorHandle:
    """The cell's coordinator (the same name and journal for a successor)."""
    if target != "coordinator":
        return e2e.coordinator()
    return e2e.coordinator(
        prepare_s=PREPARE_S, commit_s=COMMIT_S, restore_s=RESTORE_S, resume_s=RESUME_S
    )


def cell_config(e2e: E2E, kill: str, target: str, mode: str) -> FleetConfig:
    overrides: dict[str, Any] = {
        "verify_mode": mode,
        "token_delay_s": 0.03,
        "tokens_per_turn": 8,
    }
    if target == "coordinator":
        overrides["lease_grace_seconds"] = LEASE_S
    if kill == "mid_prepare":
        # A step the prepare must wait for, long enough to kill in: a waited
        # verify (wait mode) or a tool call (replay mode: the verify replays).
        overrides["verify_delay_s" if mode == "wait" else "step_delay_s"] = 0.8
    return e2e.config(**overrides)


def stalled_kind(target: str) -> str:
    return STALLED_FOR_COORDINATOR if target == "coordinator" else target


# Who waits behind that step: a waited verify holds the environment's episode;
# a tool call is a wait step of the agent's activation (model calls replay).
BLOCKED = {"wait": "environment", "replay": "agent"}


def blocked_by(mode: str) -> Callable[[dict[str, dict[str, Any]]], bool]:
    """The step a prepare must wait for is in flight."""

    def probe(stats: dict[str, dict[str, Any]]) -> bool:
        routes = stats["resources"]["inflight_by_route"]
        if mode == "wait":
            return bool(routes.get("verify", 0) >= 1)
        return bool(routes.get("guess", 0) + routes.get("hint", 0) >= 1)

    return probe


async def preparing_behind_a_blocker(fleet: Fleet) -> str | None:
    """The kind of a host preparing behind a blocker, if any."""
    for kind, host in fleet.ordered():
        status: dict[str, Any] = await host.status.remote()
        if status["phase"] == "preparing" and status["report"]["blocker_count"] >= 1:
            return kind
    return None


async def kinds_in(fleet: Fleet, kinds: Iterable[str], phase: str) -> bool:
    for kind in kinds:
        if (await fleet.hosts[kind].status.remote())["phase"] != phase:
            return False
    return True


def stalled_write(ckpt: str, kind: str) -> list[Path]:
    """The temporary records files of `kind` under `ckpt` (a write under way)."""
    # `.records-<token>.msgpack.<uuid>.tmp` (and the older `.records.<uuid>.tmp`).
    return sorted(Path(ckpt).glob(f"gym/{kind}/*/.records*.tmp"))


def failed_by(info: pytest.ExceptionInfo[CoordinationFailed], name: str) -> None:
    """The coordinator's operation failed because of the dead host, and it alone."""
    assert set(info.value.failures) == {name}, info.value.failures
    assert info.value.failures[name]["code"] == "participant_unavailable"


# --- host targets: kill one host, crash the rest, restore into a fresh fleet -------


async def recover(cell: Cell, ckpt: str, *, refused: str | None = None) -> Fleet:
    """Crash the rest of the fleet, restore `ckpt` into a fresh one and continue
    every unfinished rollout as attempt 1.  `refused`: a checkpoint that never
    became whole, whose restore must be refused before anyone is touched."""
    await crash(cell.fleet, cell.rollouts)
    scope = cell.rollouts.unfinished()
    assert scope, "nothing was in flight at the crash: the cell proves nothing"
    fresh = await cell.fresh()
    if refused is not None:
        with pytest.raises(CoordinationFailed) as info:
            await cell.gym.arestore(refused, scope)
        assert set(info.value.failures) == {"gym-manifest"}, info.value.failures
        await assert_untouched(cell.gym, fresh)
    await continue_from(cell, fresh, ckpt, scope)
    return fresh


async def continue_from(cell: Cell, fresh: Fleet, ckpt: str, scope: list[EpisodeId]) -> None:
    env = load_manifest(
        ckpt,
        kind="environment",
        instance=cell.config.server_name("environment"),
        checkpoint_id=None,
    )
    cont = await restore_and_continue(cell.gym, fresh, cell.session, ckpt, scope, cell.rollouts)
    assert cont.continued, "at least one rollout continued from its restored boundary"
    # Continued: exactly the unfinished rollouts the checkpoint holds a boundary
    # of; every other one restarts from its task input.
    held = sorted(e.rollout_id for e in scope if e.capture_key in env.episodes)
    assert sorted(cont.continued) == held, (cont.continued, env.episodes)
    assert sorted(cont.continued + cont.restarted) == sorted(e.rollout_id for e in scope)
    cell.fleet = fresh


async def prepare_then_commit(cell: Cell, prepare: Awaitable[Any]) -> None:
    await prepare
    await cell.gym.acommit(cell.c2, cell.rollouts.unfinished())


async def host_mid_prepare(cell: Cell) -> Fleet:
    await checkpoint(cell.gym, cell.rollouts, cell.c1)
    await stats_until(cell.fleet, blocked_by(cell.mode), f"a {cell.mode} step in flight")
    prepare = asyncio.ensure_future(cell.gym.aprepare())
    blocked = await until(lambda: preparing_behind_a_blocker(cell.fleet), "a blocked prepare")
    assert blocked == BLOCKED[cell.mode], blocked
    assert not prepare.done()
    name = cell.target_name()
    cell.kill_target()
    # The dead host fails the checkpoint: its prepare, or (if it had already
    # answered it) the commit that follows.
    with pytest.raises(CoordinationFailed) as info:
        await prepare_then_commit(cell, prepare)
    failed_by(info, name)
    return await recover(cell, cell.c1, refused=cell.c2)


async def host_prepared(cell: Cell) -> Fleet:
    await checkpoint(cell.gym, cell.rollouts, cell.c1)
    await cell.progress()
    await cell.gym.aprepare()
    assert await phases(cell.fleet) == {"prepared"}
    cell.kill_target()
    with pytest.raises(CoordinationFailed) as info:
        await cell.gym.acommit(cell.c2, cell.rollouts.unfinished())
    failed_by(info, cell.target_name())
    return await recover(cell, cell.c1, refused=cell.c2)


async def host_mid_commit(cell: Cell) -> Fleet:
    await checkpoint(cell.gym, cell.rollouts, cell.c1)
    await cell.progress()
    await cell.gym.aprepare()
    commit = asyncio.ensure_future(cell.gym.acommit(cell.c2, cell.rollouts.unfinished()))

    async def writing() -> list[Path]:
        return stalled_write(cell.c2, cell.target)

    (tmp,) = await until(writing, f"the {cell.target} records file being written")
    assert not commit.done()
    cell.kill_target()
    with pytest.raises(CoordinationFailed) as info:
        await commit
    failed_by(info, cell.target_name())
    assert tmp.exists(), "the kill landed mid-write: the temporary file stays"
    assert not verify_checkpoint(cell.c2).ok
    return await recover(cell, cell.c1, refused=cell.c2)


async def host_committed(cell: Cell) -> Fleet:
    await cell.gym.aprepare()
    committed = await cell.gym.acommit(cell.c1, cell.rollouts.unfinished())
    assert verify_checkpoint(cell.c1).ok
    cell.kill_target()
    resumed = await cell.gym.aresume()
    # The dead host cannot answer: reported, not raised; the others resume.
    assert resumed.checkpoint_id == committed.checkpoint_id
    assert set(resumed.failures) == {cell.target_name()}, resumed.failures
    return await recover(cell, cell.c1)


async def host_after_resume(cell: Cell) -> Fleet:
    await cell.gym.acheckpoint(cell.c1, cell.rollouts.unfinished())
    assert verify_checkpoint(cell.c1).ok
    await cell.progress()
    cell.kill_target()
    return await recover(cell, cell.c1)


async def mid_restore_of(cell: Cell) -> tuple[Fleet, list[EpisodeId], asyncio.Future[Any]]:
    """A whole checkpoint, a crash, and a fresh fleet restoring it, with every
    host installed but the stalled one, which is still reading its records."""
    await cell.gym.acheckpoint(cell.c1, cell.rollouts.unfinished())
    await crash(cell.fleet, cell.rollouts)
    scope = cell.rollouts.unfinished()
    assert scope, "nothing was in flight at the crash: the cell proves nothing"
    second = await cell.fresh(stalled_kind(cell.target), gate=cell.gate, read=True)
    restore = asyncio.ensure_future(cell.gym.arestore(cell.c1, scope))
    stalled = stalled_kind(cell.target)
    others = [k for k in fleet_module.KIND_ORDER if k != stalled]
    await until(lambda: kinds_in(second, others, "restored"), f"all but {stalled} restored")
    assert await kinds_in(second, [stalled], "idle"), f"{stalled} is still reading"
    assert not restore.done()
    return second, scope, restore


async def host_mid_restore(cell: Cell) -> Fleet:
    second, scope, restore = await mid_restore_of(cell)
    cell.kill_target(second)
    with pytest.raises(CoordinationFailed) as info:
        await restore
    failed_by(info, cell.target_name(second))
    # All or nothing: every survivor undid its install by retiring the attempts
    # the restore would have continued...
    for kind, host in second.ordered():
        if kind != cell.target:
            status = await host.status.remote()
            assert status["retired_rollouts"] == len(scope), (kind, status)
            assert status["phase"] == "idle", (kind, status)
    # ...and restored once already: a third fleet takes over.
    second.kill()
    third = await cell.fresh()
    await continue_from(cell, third, cell.c1, scope)
    return third


HOST_KILLS: dict[str, Callable[[Cell], Awaitable[Fleet]]] = {
    "mid_prepare": host_mid_prepare,
    "prepared": host_prepared,
    "mid_commit": host_mid_commit,
    "committed": host_committed,
    "after_resume": host_after_resume,
    "mid_restore": host_mid_restore,
}


# --- the coordinator as target: leases lapse, a successor recovers ---------------


async def lapse_and_succeed(cell: Cell, fleet: Fleet, killed: float) -> str | None:
    """Every participant resumes by itself; then a successor under the same name
    and journal recovers; returns what it recovered (the dead one's open ID)."""

    await reads_until(
        lambda: host_phases(fleet),
        lambda seen: set(seen.values()) == {"idle"},
        "every participant to resume on its own",
        timeout_s=20,
    )
    lapsed_s = time.monotonic() - killed
    # Within the lease (the call's deadline + grace), plus slack for a loaded machine.
    assert lapsed_s < max(PREPARE_S, COMMIT_S, RESTORE_S, RESUME_S) + LEASE_S + 10, lapsed_s

    async def successor() -> tuple[CoordinatorHandle, str | None] | None:
        handle = coordinator(cell.e2e, "coordinator")
        try:
            recovered: str | None = await handle.actor.ping.remote()
        except Exception:
            return None  # the dead one's name was not released yet
        return handle, recovered

    found = await until(successor, "a new coordinator under the same name", timeout_s=30)
    assert found is not None
    cell.gym, recovered = found
    return recovered


async def carry_on(cell: Cell) -> Fleet:
    """The fleet lived: rollouts carry on in place after the lapse."""
    tokens = (await fleet_stats(cell.fleet))["model"]["tokens_generated"]
    await stats_until(
        cell.fleet,
        lambda s: s["model"]["tokens_generated"] > tokens or not cell.rollouts.unfinished(),
        "rollouts to carry on after the lapse",
    )
    return cell.fleet


async def coordinator_mid_prepare(cell: Cell) -> Fleet:
    await stats_until(cell.fleet, blocked_by(cell.mode), f"a {cell.mode} step in flight")
    prepare = asyncio.ensure_future(cell.gym.aprepare())
    blocked = await until(lambda: preparing_behind_a_blocker(cell.fleet), "a blocked prepare")
    assert blocked == BLOCKED[cell.mode], blocked
    assert not prepare.done()
    cell.kill_target()
    killed = time.monotonic()
    with pytest.raises(ParticipantUnavailable):
        await prepare
    recovered = await lapse_and_succeed(cell, cell.fleet, killed)
    assert recovered is not None
    assert recovered.startswith("ckpt-"), recovered
    return await carry_on(cell)


async def coordinator_prepared(cell: Cell) -> Fleet:
    prepared = await cell.gym.aprepare()
    assert await phases(cell.fleet) == {"prepared"}
    cell.kill_target()
    recovered = await lapse_and_succeed(cell, cell.fleet, time.monotonic())
    assert recovered == prepared.checkpoint_id
    return await carry_on(cell)


async def coordinator_mid_commit(cell: Cell) -> Fleet:
    prepared = await cell.gym.aprepare()
    commit = asyncio.ensure_future(cell.gym.acommit(cell.c2, cell.rollouts.unfinished()))
    stalled = stalled_kind(cell.target)

    async def writing() -> list[Path]:
        return stalled_write(cell.c2, stalled)

    await until(writing, f"the {stalled} records file being written")
    assert not commit.done()
    cell.kill_target()
    killed = time.monotonic()
    cell.open_gate()  # the write goes on and ends, with nobody to reply to
    with pytest.raises(ParticipantUnavailable):
        await commit
    recovered = await lapse_and_succeed(cell, cell.fleet, killed)
    assert recovered == prepared.checkpoint_id
    # Nobody wrote the Gym manifest: not a checkpoint anyone can restore.
    assert not verify_checkpoint(cell.c2).ok
    return await carry_on(cell)


async def coordinator_committed(cell: Cell) -> Fleet:
    prepared = await cell.gym.aprepare()
    await cell.gym.acommit(cell.c1, cell.rollouts.unfinished())
    cell.kill_target()
    recovered = await lapse_and_succeed(cell, cell.fleet, time.monotonic())
    assert recovered == prepared.checkpoint_id
    assert verify_checkpoint(cell.c1).ok, "the dead coordinator's checkpoint is whole"
    return await carry_on(cell)


async def coordinator_after_resume(cell: Cell) -> Fleet:
    await cell.gym.acheckpoint(cell.c1, cell.rollouts.unfinished())
    cell.kill_target()
    assert await phases(cell.fleet) == {"idle"}
    recovered = await lapse_and_succeed(cell, cell.fleet, time.monotonic())
    assert recovered is None, "nothing was open"
    return await carry_on(cell)


async def coordinator_mid_restore(cell: Cell) -> Fleet:
    second, scope, restore = await mid_restore_of(cell)
    cell.kill_target()
    killed = time.monotonic()
    cell.open_gate()  # the stalled host reads and installs, with nobody to reply to
    with pytest.raises(ParticipantUnavailable):
        await restore
    recovered = await lapse_and_succeed(cell, second, killed)
    assert recovered is not None
    assert recovered.startswith("restore-"), recovered
    # The half-restored fleet restored once already: a fresh one takes over.
    second.kill()
    third = await cell.fresh()
    await continue_from(cell, third, cell.c1, scope)
    return third


COORDINATOR_KILLS: dict[str, Callable[[Cell], Awaitable[Fleet]]] = {
    "mid_prepare": coordinator_mid_prepare,
    "prepared": coordinator_prepared,
    "mid_commit": coordinator_mid_commit,
    "committed": coordinator_committed,
    "after_resume": coordinator_after_resume,
    "mid_restore": coordinator_mid_restore,
}


def in_default_run(kill: str, target: str, mode: str) -> bool:
    """Every kill point x every target, each cell in one step mode, alternating
    so that each kill point and each target meets both modes (the full 60 cells
    take about twice as long as CI allows; `RAY_CKPT_CRASH_MATRIX=full` runs them)."""
    return MODES[(KILLS.index(kill) + TARGETS.index(target)) % 2] == mode


def cells() -> list[Any]:
    full = os.environ.get("RAY_CKPT_CRASH_MATRIX") == "full"
    return [
        pytest.param(kill, target, mode, id=f"{kill}-{target}-{mode}")
        for kill in KILLS
        for target in TARGETS
        for mode in MODES
        if full or in_default_run(kill, target, mode)
    ]


@pytest.mark.parametrize(("kill", "target", "mode"), cells())
async def test_crash_matrix(e2e: E2E, kill: str, target: str, mode: str) -> None:
    config = cell_config(e2e, kill, target, mode)
    expected = await e2e.baseline(config, N, STEPS, SEED)
    gym = coordinator(e2e, target)
    mid_commit = kill == "mid_commit"
    held = stalled_kind(target) if mid_commit else None
    with stalls(held, gate=str(e2e.tmp / "gate"), write_dir="c2"):
        fleet = await e2e.launch(config)
    rollouts, tally = e2e.rollouts(N, STEPS, SEED)
    async with data_session(256, 256) as session:
        cell = Cell(e2e, kill, target, mode, gym, rollouts, session, config, fleet)
        for i, r in enumerate(rollouts.tasks):
            rollouts.start(session, fleet.urls["environment"], r, delay_s=0.15 * i)
        await stats_until(fleet, under_way, "every rollout past its seed, mid-generation")
        kills = COORDINATOR_KILLS if target == "coordinator" else HOST_KILLS
        final = await kills[kill](cell)
        await rollouts.wait(timeout_s=60)
    assert_exactly_once(rollouts, tally, expected)
    # Each rollout ran as attempt 0 only, or went on once as attempt 1.
    assert set(tally.attempt.values()) <= {0, 1}, tally.attempt
    if target == "coordinator" and kill != "mid_restore":
        assert set(tally.attempt.values()) == {0}, "the fleet lived: nothing restarted"
    await assert_clean(final)
