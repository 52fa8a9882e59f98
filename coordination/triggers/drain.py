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

A move can fail after its checkpoint is complete (no room for the hosts
elsewhere, a restore that fails).  The checkpoint is `latest` either way; the
failure is reported with its ID and the move is tried again, at most
`MOVE_ATTEMPTS` times in all, `MOVE_BACKOFF_S` then twice that apart, on the
polls after those times:

- the relaunch failed: the old hosts were resumed (`DrainActions.relaunch`
  resumes them, or nobody could checkpoint until their leases lapse) and have
  run on since, so the retry is the whole drain again while the node is still
  draining — a fresh checkpoint inside what is left of its deadline, so what
  they did meanwhile is not lost;
- the restore failed: the old hosts are gone and the fresh ones hold nothing,
  so the retry is the restore from the same checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from coordination.engine.baseline import Trigger
from coordination.triggers.periodic import DEFAULT_PREFIX, checkpoint_name, error_body
from coordination.triggers.signals import Budget, cut_budget
from ray_ckpt.errors import DeadlineExceeded
from ray_ckpt.storage.blobstore.locations import join_location

log = logging.getLogger(__name__)

# A checkpoint needs at least this long after the margin; less is reported.
DEFAULT_MIN_BUDGET_S = 2.0
# Kept back from the deadline: the node may go a little early.
DEFAULT_MARGIN_S = 1.0
# A drain without a deadline still ends: checkpoint as if it had this long.
NO_DEADLINE_BUDGET_S = 60.0
# A move that fails after its checkpoint: this many attempts in all, the
# first retry this long after the failure, each later one twice as long.
MOVE_ATTEMPTS = 3
MOVE_BACKOFF_S = 2.0


def move_backoff(attempt: int) -> float:
    """The wait after failed attempt `attempt` (1-based) before the next one."""
    return MOVE_BACKOFF_S * 2.0 ** (attempt - 1)


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
    attempt: int = 1  # of MOVE_ATTEMPTS
    retry_at: float | None = None  # a failed move tried again from then (epoch s)


@dataclass
class _Retry:
    """A move to try again (`DrainWatcher.retries`)."""

    nodes: list[str]
    hosts: list[str]
    deadline: float | None
    attempt: int  # attempts made
    at: float  # not before (epoch s)
    # Set once the hosts moved: only the restore from here is left.
    location: str | None = None
    checkpoint_id: str | None = None
    moved: dict[str, str] = field(default_factory=dict)


class DrainActions(Protocol):
    async def placement(self) -> dict[str, str]:
        """Host name → the node it runs on."""
        ...

    async def checkpoint(self, location: str, budget: Budget) -> Any:
        """The whole Gym, with `stop`, left paused (a `CheckpointResult`)."""
        ...

    async def relaunch(self, hosts: list[str], avoid: list[str]) -> dict[str, str]:
        """The hosts again, same names, on nodes not in `avoid`; host → node.

        Either way the kept-open checkpoint is resumed: on failure the old
        hosts run on (admission open), so the next checkpoint is not refused."""
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
        self.retries: list[_Retry] = []

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
        now = self.wall()
        due = next((r for r in self.retries if now >= r.at), None)
        if due is not None:
            self.retries.remove(due)
            retried = await self._retry(due, draining)
            if retried is not None:
                self.outcomes.append(retried)
            return retried
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

    def _again(self, retry: _Retry) -> float | None:
        """Schedule `retry` unless its attempts are spent; when it will run."""
        if retry.attempt >= MOVE_ATTEMPTS:
            log.error("drain of %s: %d attempts failed; not moved", retry.nodes, retry.attempt)
            return None
        retry.at = self.wall() + move_backoff(retry.attempt)
        self.retries.append(retry)
        return retry.at

    async def _retry(
        self, retry: _Retry, draining: Mapping[str, float | None]
    ) -> DrainOutcome | None:
        if retry.location is not None:
            return await self._restore_again(retry)
        still = {n: draining[n] for n in retry.nodes if n in draining}
        plan = plan_drain(
            still,
            await self.actions.placement(),
            set(),
            self.wall(),
            min_budget_s=self.min_budget_s,
            margin_s=self.margin_s,
        )
        if plan is None:
            # The drain was called off, or the hosts are on other nodes now:
            # nothing left to move, the old hosts run on.
            log.info("drain of %s: no longer draining Gym hosts; move not retried", retry.nodes)
            return None
        return await self._carry_out(plan, attempt=retry.attempt + 1)

    async def _restore_again(self, retry: _Retry) -> DrainOutcome:
        assert retry.location is not None
        start = self.wall()
        retry.attempt += 1
        kw: dict[str, Any] = {
            "trigger": Trigger.DRAIN.value,
            "nodes": retry.nodes,
            "hosts": retry.hosts,
            "deadline": retry.deadline,
            "budget_s": 0.0,
            "location": retry.location,
            "checkpoint_id": retry.checkpoint_id,
            "moved": retry.moved,
            "attempt": retry.attempt,
        }
        try:
            await self.actions.restore(retry.location)
        except Exception as exc:
            log.error(
                "drain: checkpoint %s is complete, its restore failed again: %s",
                retry.checkpoint_id,
                exc,
            )
            at = self._again(retry)
            return DrainOutcome(
                ok=False, error=error_body(exc), retry_at=at, seconds=self.wall() - start, **kw
            )
        return DrainOutcome(ok=True, seconds=self.wall() - start, **kw)

    async def _carry_out(self, plan: DrainPlan, *, attempt: int = 1) -> DrainOutcome:
        start = self.wall()

        def outcome(**kw: Any) -> DrainOutcome:
            return DrainOutcome(
                trigger=Trigger.DRAIN.value,
                nodes=plan.nodes,
                hosts=plan.hosts,
                deadline=plan.deadline,
                budget_s=plan.budget_s,
                seconds=self.wall() - start,
                attempt=attempt,
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
        retry = _Retry(plan.nodes, plan.hosts, plan.deadline, attempt, at=0.0)
        try:
            moved = await self.actions.relaunch(plan.hosts, plan.nodes)
        except Exception as exc:
            # The checkpoint is complete and `latest`; the old hosts were
            # resumed and run on until the retry (see the module doc).
            log.error("drain: checkpoint %s is complete, the relaunch failed: %s", cid, exc)
            at = self._again(retry)
            return outcome(
                ok=False, location=where, checkpoint_id=cid, error=error_body(exc), retry_at=at
            )
        try:
            await self.actions.restore(where)
        except Exception as exc:
            log.error("drain: checkpoint %s is complete, its restore failed: %s", cid, exc)
            retry.location, retry.checkpoint_id, retry.moved = where, cid, moved
            at = self._again(retry)
            return outcome(
                ok=False,
                location=where,
                checkpoint_id=cid,
                moved=moved,
                error=error_body(exc),
                retry_at=at,
            )
        log.info("drain of %s: hosts %s moved via %s", plan.nodes, plan.hosts, where)
        return outcome(ok=True, location=where, checkpoint_id=cid, moved=moved)
