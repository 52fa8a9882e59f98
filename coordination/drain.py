"""Ray node drains: checkpoint inside the deadline, move the node's hosts, restore.

When a node holding Gym hosts starts draining with a deadline (a spot
preemption, `ray drain-node --reason=DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds N`), `DrainWatcher` checkpoints the whole Gym
with `stop` inside that deadline, relaunches the draining node's hosts on
other nodes under the same names and restores the whole Gym from that
checkpoint: a planned move that loses no step.  A deadline too short for a
checkpoint is reported and nothing is attempted, so nothing is half-published
and the last complete checkpoint stays `latest`.

Where the drain state comes from (Ray 2.60, checked on a local 2-node
cluster): `ray.nodes()` is public but shows a draining node exactly like
any other (`Alive`, `DeathReason` 0); `ray.util.state.list_nodes` needs the
dashboard's state API and knows only ALIVE/DEAD; `ray drain-node` is a hidden
CLI over the GCS `DrainNode` call and "not covered by Ray's public API
stability guarantees".  The draining set with its deadlines is only in
`ray._private.state.state.get_draining_nodes()` (`{node_id_hex:
deadline_ms}`, 0 = no deadline), the call Ray Serve's controller and Ray
Train's preemption watcher poll.  So the source is injected (`DrainSource`)
and `RayDrainSource` is the one place touching that private call.

The decision (`plan_drain`) is pure: draining nodes, where each host runs,
the nodes already handled and the time in, a `DrainPlan` (or None) out.
Several nodes draining at once make one plan: one checkpoint of the whole
Gym, inside the earliest deadline.  The effects (placement, checkpoint,
relaunch, restore) are `DrainActions`, the coordinator's to carry out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import msgspec

from coordination.periodic import DEFAULT_PREFIX, checkpoint_name, error_body
from coordination.signals import Budget, cut_budget
from ray_ckpt.errors import DeadlineExceeded
from ray_ckpt.storage.pointer import join_location

log = logging.getLogger(__name__)

# A checkpoint needs at least this long after the margin; less is reported.
DEFAULT_MIN_BUDGET_S = 2.0
# Kept back from the deadline: the node may go a little early.
DEFAULT_MARGIN_S = 1.0
# A drain without a deadline still ends: checkpoint as if it had this long.
NO_DEADLINE_BUDGET_S = 60.0


class DrainSource(Protocol):
    def draining(self) -> dict[str, float | None]:
        """Draining node ID (hex) → its deadline (seconds since the epoch; None: none)."""
        ...


class RayDrainSource:
    """Ray's draining nodes (the private GCS accessor; see the module doc)."""

    def draining(self) -> dict[str, float | None]:
        import ray

        raw: dict[str, int] = ray._private.state.state.get_draining_nodes()
        return {node: (ms / 1000.0 if ms else None) for node, ms in raw.items()}


class DrainPlan(msgspec.Struct, frozen=True, kw_only=True):
    nodes: list[str]  # draining nodes holding Gym hosts
    hosts: list[str]  # the hosts on them
    deadline: float | None  # the earliest deadline (epoch s)
    budget_s: float  # what the checkpoint may take
    too_short: bool = False


def plan_drain(
    draining: Mapping[str, float | None],
    placement: Mapping[str, str],
    handled: set[str],
    now: float,
    *,
    min_budget_s: float = DEFAULT_MIN_BUDGET_S,
    margin_s: float = DEFAULT_MARGIN_S,
) -> DrainPlan | None:
    """What to do about the nodes draining now; None when none is ours and new.

    `placement`: host name → node ID; `handled`: nodes a plan already covered
    (a drain stays listed until the node is gone)."""
    nodes = sorted(n for n in draining if n not in handled and n in placement.values())
    if not nodes:
        return None
    hosts = sorted(h for h, n in placement.items() if n in nodes)
    deadlines = [d for d in (draining[n] for n in nodes) if d is not None]
    deadline = min(deadlines) if deadlines else None
    budget = NO_DEADLINE_BUDGET_S if deadline is None else deadline - now - margin_s
    return DrainPlan(
        nodes=nodes,
        hosts=hosts,
        deadline=deadline,
        budget_s=max(0.0, budget),
        too_short=budget < min_budget_s,
    )


class DrainOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """One drain handled: moved, failed, or reported as too short."""

    trigger: str  # "drain"
    nodes: list[str]
    hosts: list[str]
    deadline: float | None
    budget_s: float
    ok: bool
    location: str | None = None
    checkpoint_id: str | None = None
    moved: dict[str, str] = msgspec.field(default_factory=dict)  # host → its new node
    # participant → the next-attempt capture keys its restore installed
    restored: dict[str, list[str]] = msgspec.field(default_factory=dict)
    seconds: float = 0.0
    error: dict[str, Any] | None = None


class DrainActions(Protocol):
    async def placement(self) -> dict[str, str]:
        """Host name → the node it runs on."""
        ...

    async def checkpoint(self, location: str, budget: Budget) -> Any:
        """The whole Gym, with `stop`, left paused (a `CheckpointResult`)."""
        ...

    async def relaunch(self, hosts: list[str], avoid: list[str]) -> dict[str, str]:
        """The hosts again, same names, on nodes not in `avoid`; host → node."""
        ...

    async def restore(self, location: str) -> Any:
        """Restore the whole Gym from `location` into the fresh hosts and resume."""
        ...


class DrainWatcher:
    """Polls `source` and carries out each new plan through `actions`."""

    def __init__(
        self,
        source: DrainSource,
        actions: DrainActions,
        root: str,
        *,
        poll_s: float = 1.0,
        min_budget_s: float = DEFAULT_MIN_BUDGET_S,
        margin_s: float = DEFAULT_MARGIN_S,
        prefix: str = DEFAULT_PREFIX,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.source = source
        self.actions = actions
        self.root = root
        self.poll_s = poll_s
        self.min_budget_s = min_budget_s
        self.margin_s = margin_s
        self.prefix = prefix
        self.wall = wall
        self.sleep = sleep
        self.handled: set[str] = set()
        self.outcomes: list[DrainOutcome] = []

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until `stop`; a failing poll is logged and the next one runs."""
        while not stop.is_set():
            try:
                await self.poll_once()
            except Exception:
                log.exception("drain poll failed; polling on")
            await self.sleep(self.poll_s)

    async def poll_once(self) -> DrainOutcome | None:
        draining = await asyncio.to_thread(self.source.draining)
        if not draining:
            return None
        plan = plan_drain(
            draining,
            await self.actions.placement(),
            self.handled,
            self.wall(),
            min_budget_s=self.min_budget_s,
            margin_s=self.margin_s,
        )
        if plan is None:
            return None
        self.handled.update(plan.nodes)
        outcome = await self._carry_out(plan)
        self.outcomes.append(outcome)
        return outcome

    async def _carry_out(self, plan: DrainPlan) -> DrainOutcome:
        start = self.wall()

        def outcome(**kw: Any) -> DrainOutcome:
            return DrainOutcome(
                trigger="drain",
                nodes=plan.nodes,
                hosts=plan.hosts,
                deadline=plan.deadline,
                budget_s=plan.budget_s,
                seconds=self.wall() - start,
                **kw,
            )

        if plan.too_short:
            err = DeadlineExceeded(
                f"nodes {plan.nodes} drain in {plan.budget_s:.1f}s (after a {self.margin_s:g}s "
                f"margin): too short for a checkpoint (>= {self.min_budget_s:g}s); none taken"
            )
            log.error("%s", err)
            return outcome(ok=False, error=error_body(err))
        name = f"{checkpoint_name(self.prefix, start)}-drain"
        where = join_location(self.root, name)
        try:
            result = await self.actions.checkpoint(where, cut_budget(plan.budget_s, 0.0))
        except Exception as exc:
            log.error("drain checkpoint %s failed; latest is unchanged: %s", where, exc)
            return outcome(ok=False, location=where, error=error_body(exc))
        cid = getattr(result, "checkpoint_id", None)
        try:
            moved = await self.actions.relaunch(plan.hosts, plan.nodes)
            await self.actions.restore(where)
        except Exception as exc:
            # The checkpoint is complete and `latest`: a restore from it later
            # still loses nothing.
            log.error("drain: checkpoint %s is complete, the move failed: %s", where, exc)
            return outcome(ok=False, location=where, checkpoint_id=cid, error=error_body(exc))
        log.info("drain of %s: hosts %s moved via %s", plan.nodes, plan.hosts, where)
        return outcome(ok=True, location=where, checkpoint_id=cid, moved=moved)
