"""The coordinator's own drain watch: Ray node drains handled where the Gym is.

`DrainControl` is what the `Coordinator` actor holds: a `DrainWatcher`
(`coordination.triggers.drain`) polling Ray's draining nodes, run as a task of the
actor, with `CoordinatorDrainActions` as its effects:

- placement: the node each registered Ray-actor participant runs on (asked of
  the actor; HTTP-only participants have no Ray node and are never moved);
- checkpoint: the whole Gym with `stop`, kept open, its scope from the
  registered assembler, inside the drain's deadline (`total_s`: one not ready
  to publish in time is not published, and `latest` stays the previous one);
- relaunch: the caller's relauncher (a picklable async callable, e.g.
  `participants.fleet_relaunch.FleetRelauncher`), then the kept-open
  checkpoint is resumed (its members are the dead hosts: they drop out; if
  the relauncher failed, the old hosts run on until the watch retries the
  move, see `coordination.triggers.drain`);
- restore: the whole Gym from that checkpoint into the fresh hosts, resumed.

The driver learns of a move from `drain_status()` (its outcomes carry what
the restore installed, so it starts attempt + 1 of each restored rollout) or
from its own `/run` calls failing when the old hosts stop.  The watch is not
kept across a coordinator restart (the relauncher is the caller's object):
start it again after one, as the periodic loop's caller would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

from coordination.engine.baseline import Trigger
from coordination.engine.coordinator_core import CoordinatorCore, ScopeSource
from coordination.engine.options import CheckpointOptions
from coordination.engine.results import RestoreResult
from coordination.reach.hosts import RayHost
from coordination.triggers.drain import (
    DEFAULT_MARGIN_S,
    DEFAULT_MIN_BUDGET_S,
    DrainOutcome,
    DrainSource,
    DrainWatcher,
    RayDrainSource,
)
from coordination.triggers.periodic import DEFAULT_PREFIX
from coordination.triggers.signal_budget import Budget
from ray_ckpt.errors import CheckpointConflict, InvalidRequest

log = logging.getLogger(__name__)

# (member keys on the draining nodes, the draining nodes) → moved key → node
Relauncher = Callable[[list[str], list[str]], Awaitable[dict[str, str]]]
KEPT_OUTCOMES = 20


class DrainingCoordinator(Protocol):
    """What the drain's actions use of the `Coordinator` actor that holds them
    (a protocol: this module is the actor's, and imports it not)."""

    core: CoordinatorCore

    @property
    def scope_source(self) -> ScopeSource | None: ...

    async def _ready(self, *, discover: bool = False, refresh: bool = False) -> None: ...

    async def restore(self, checkpoint_dir: str) -> RestoreResult: ...


class DrainStatus(msgspec.Struct, frozen=True, kw_only=True):
    running: bool
    root: str | None = None
    poll_s: float | None = None
    outcomes: list[DrainOutcome] = msgspec.field(default_factory=list)


class CoordinatorDrainActions:
    def __init__(self, coordinator: DrainingCoordinator, relaunch: Relauncher) -> None:
        self.coordinator = coordinator
        self.relaunch_hosts = relaunch
        self.restored: dict[str, list[str]] = {}

    async def placement(self) -> dict[str, str]:
        # Discovery first: the watch may start before any other call registered the hosts.
        await self.coordinator._ready(discover=True)
        hosts = [h for h in self.coordinator.core.hosts.values() if isinstance(h, RayHost)]
        infos = await asyncio.gather(
            *(h.handle.ready.remote() for h in hosts), return_exceptions=True
        )
        out: dict[str, str] = {}
        for host, info in zip(hosts, infos, strict=True):
            if isinstance(info, BaseException):
                log.warning("drain watch: %s does not say where it runs: %r", host.member, info)
                continue
            out[host.member.key] = str(info["node_id"])
        return out

    async def checkpoint(self, location: str, budget: Budget) -> Any:
        self.restored = {}
        c = self.coordinator
        await c._ready(discover=True)
        # Kept open (resume=False): the hosts move before anyone resumes.
        options = CheckpointOptions(
            checkpoint_dir=location,
            resume=False,
            stop=True,
            prepare_s=budget.prepare_s,
            commit_s=budget.commit_s,
            total_s=budget.total_s,
            trigger=Trigger.DRAIN.value,
        )
        return await c.core.checkpoint(options, scope_source=c.scope_source)

    async def relaunch(self, hosts: list[str], avoid: list[str]) -> dict[str, str]:
        try:
            moved = await self.relaunch_hosts(hosts, avoid)
        finally:
            # The checkpoint kept open for the move is done either way.  Moved:
            # its members were the old hosts (now dead: they drop out), the
            # fresh ones never saw it.  Not moved: the old hosts run on until
            # the move is tried again — left committed, they would refuse
            # admission and every checkpoint (`checkpoint_conflict`) until
            # their leases lapse.
            await self.coordinator.core.resume()
        return moved

    async def restore(self, location: str) -> Any:
        result = await self.coordinator.restore(location)
        self.restored = dict(result.restored)
        return result


class DrainControl:
    """One drain watch at a time inside the coordinator."""

    def __init__(self, coordinator: DrainingCoordinator) -> None:
        self.coordinator = coordinator
        self.watcher: DrainWatcher | None = None
        self.actions: CoordinatorDrainActions | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._outcomes: list[DrainOutcome] = []

    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(
        self,
        root: str,
        relaunch: Relauncher,
        *,
        poll_s: float = 1.0,
        min_budget_s: float = DEFAULT_MIN_BUDGET_S,
        margin_s: float = DEFAULT_MARGIN_S,
        prefix: str = DEFAULT_PREFIX,
        source: DrainSource | None = None,
    ) -> DrainStatus:
        if self.running():
            assert self.watcher is not None
            raise CheckpointConflict(f"a drain watch over {self.watcher.root} is running")
        if not callable(relaunch):
            raise InvalidRequest("relaunch must be an async callable (hosts, avoid) -> moved")
        if not poll_s > 0:
            raise InvalidRequest(f"poll_s must be positive, not {poll_s!r}")
        self.actions = CoordinatorDrainActions(self.coordinator, relaunch)
        self.watcher = DrainWatcher(
            source or RayDrainSource(),
            self.actions,
            root,
            poll_s=poll_s,
            min_budget_s=min_budget_s,
            margin_s=margin_s,
            prefix=prefix,
        )
        self._stop = asyncio.Event()
        self._task = asyncio.ensure_future(self._run(self.watcher))
        return self.status()

    async def _run(self, watcher: DrainWatcher) -> None:
        # The watcher's own loop logs a failing poll and polls on; the outcome
        # of each handled drain is kept here, with what its restore installed.
        while not self._stop.is_set():
            try:
                out = await watcher.poll_once()
            except Exception:
                log.exception("drain poll failed; polling on")
                out = None
            if out is not None:
                restored = self.actions.restored if self.actions is not None else {}
                self._outcomes.append(msgspec.structs.replace(out, restored=dict(restored)))
                del self._outcomes[:-KEPT_OUTCOMES]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), watcher.poll_s)

    async def stop(self) -> DrainStatus:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return self.status()

    def status(self) -> DrainStatus:
        w = self.watcher
        return DrainStatus(
            running=self.running(),
            root=w.root if w is not None else None,
            poll_s=w.poll_s if w is not None else None,
            outcomes=list(self._outcomes),
        )
