"""Periodic checkpoints inside the coordinator: a timer, names, retention.

`PeriodicRunner` owns one background loop: every `every_s` it checkpoints
into ``<root>/<prefix><UTC time>`` (names sort by time, so a listing by name
is a listing by age), and after each complete checkpoint applies
`keep_latest_k` under the root.  A failed checkpoint is counted, kept as the
last error (shown by `status`) and logged; the loop goes on and the next one
runs on time.  The checkpoint itself goes through the coordinator's lock like
any other, so a manual checkpoint and a periodic one never overlap (the later
waits; one left open for publishing makes the periodic one fail, reported).

Timing reads the coordinator's injected clock; the wait between checkpoints
is an injected `sleep` (tests drive both).  When a checkpoint overruns its
period the missed ticks are skipped, never run back to back.

One loop at a time: starting one while another runs is `CheckpointConflict`,
unless it is the same loop (same root, period, retention and prefix), which
makes `start_periodic` idempotent for a trainer that restarts.  `stop` lets a
checkpoint in flight finish (it is bounded by its own deadlines) and returns
the final status.  The coordinator keeps the loop's settings beside its
journal (`coordination.actor.periodic_control`), so a coordinator that Ray restarts
runs the same loop again (counts start over); `stop` forgets them.

The scope of a checkpoint taken without one comes from the registered
assembler when it names a scope method (`AssemblerScope`): asked after the
prepare, while the assembler is paused, so no episode can start in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from coordination.engine.results import CheckpointResult, PeriodicStatus
from ray_ckpt.clock import Clock
from ray_ckpt.errors import CheckpointConflict, CheckpointError, DeadlineExceeded, InvalidRequest
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.blobstore.locations import join_location
from ray_ckpt.storage.root.retention import GcPlan

log = logging.getLogger(__name__)

# (root, checkpoint location) → the checkpoint taken there
Checkpoint = Callable[[str, str], Awaitable[CheckpointResult]]
Retain = Callable[[str, int], Awaitable[GcPlan]]
Sleep = Callable[[float], Awaitable[None]]

DEFAULT_PREFIX = "ckpt-"
_PREFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*|")


def checkpoint_name(prefix: str, now: float) -> str:
    """`<prefix>20261204T021500123Z`: UTC to the millisecond, so names sort by time."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    return f"{prefix}{stamp}{int(now * 1000) % 1000:03d}Z"


def error_body(exc: BaseException, **extra: Any) -> dict[str, Any]:
    err = exc if isinstance(exc, CheckpointError) else CheckpointError(repr(exc)[:500])
    body: dict[str, Any] = {"code": err.code, "detail": err.detail, **extra}
    failures = getattr(err, "failures", None)
    if failures:
        body["failures"] = failures
    return body


@dataclass
class _Loop:
    root: str
    every_s: float
    keep: int | None
    prefix: str
    started_at: float
    next_at: float
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    running: bool = True
    attempts: int = 0
    completed: int = 0
    failed: int = 0
    consecutive: int = 0
    last_name: str | None = None
    last_checkpoint_id: str | None = None
    last_completed_at: float | None = None
    last_error: dict[str, Any] | None = None
    deleted: int = 0
    last_retention_error: dict[str, Any] | None = None

    def same(self, root: str, every_s: float, keep: int | None, prefix: str) -> bool:
        return (self.root, self.every_s, self.keep, self.prefix) == (root, every_s, keep, prefix)

    def status(self) -> PeriodicStatus:
        return PeriodicStatus(
            root=self.root,
            every_s=self.every_s,
            keep_latest_k=self.keep,
            running=self.running,
            started_at=self.started_at,
            next_at=self.next_at if self.running else None,
            attempts=self.attempts,
            completed=self.completed,
            failed=self.failed,
            consecutive_failures=self.consecutive,
            last_name=self.last_name,
            last_checkpoint_id=self.last_checkpoint_id,
            last_completed_at=self.last_completed_at,
            last_error=self.last_error,
            deleted=self.deleted,
            last_retention_error=self.last_retention_error,
        )


class PeriodicRunner:
    def __init__(
        self, checkpoint: Checkpoint, retain: Retain, clock: Clock, sleep: Sleep = asyncio.sleep
    ) -> None:
        self._checkpoint = checkpoint
        self._retain = retain
        self._clock = clock
        self._sleep = sleep
        self._loop: _Loop | None = None
        self._task: asyncio.Task[None] | None = None

    def status(self) -> PeriodicStatus | None:
        """The running loop's status, or the last one's after it stopped."""
        return self._loop.status() if self._loop is not None else None

    def start(
        self,
        root: str,
        *,
        every_s: float,
        keep_latest_k: int | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> PeriodicStatus:
        """Start the loop (the caller has checked `root`); see the module doc."""
        if isinstance(every_s, bool) or not isinstance(every_s, int | float):
            raise InvalidRequest(f"every_s must be a number of seconds, not {every_s!r}")
        if not math.isfinite(every_s) or every_s <= 0:
            raise InvalidRequest(f"every_s must be > 0 (got {every_s!r})")
        keep = keep_latest_k
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise InvalidRequest(f"keep_latest_k must be an integer >= 1 (got {keep_latest_k!r})")
        if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
            raise InvalidRequest(f"bad checkpoint name prefix {prefix!r}")
        every = float(every_s)
        current = self._loop
        if current is not None and current.running:
            if current.same(root, every, keep_latest_k, prefix):
                return current.status()
            raise CheckpointConflict(
                f"a periodic checkpoint loop already runs under {current.root!r} every "
                f"{current.every_s:g}s: stop it first"
            )
        now = self._clock.now()
        loop = _Loop(root, every, keep_latest_k, prefix, started_at=now, next_at=now + every)
        self._loop = loop
        self._task = asyncio.get_running_loop().create_task(self._run(loop))
        log.info("periodic checkpoints under %s every %gs", root, every)
        return loop.status()

    async def stop(self) -> PeriodicStatus | None:
        """Stop the loop after the checkpoint in flight, if any; idempotent."""
        loop, task = self._loop, self._task
        if loop is None:
            return None
        loop.stopping.set()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(task)
        self._task = None
        return loop.status()

    async def aclose(self) -> None:
        """Cancel outright (the coordinator is going away)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self, loop: _Loop) -> None:
        try:
            while not await self._wait(max(0.0, loop.next_at - self._clock.now()), loop):
                await self._tick(loop)
                now = self._clock.now()
                loop.next_at += loop.every_s
                if loop.next_at <= now:
                    # Overran: skip the missed ticks rather than run them back to back.
                    loop.next_at = now + loop.every_s
        finally:
            loop.running = False

    async def _wait(self, delay: float, loop: _Loop) -> bool:
        """Sleep `delay`; True if a stop came first."""
        sleeper = asyncio.ensure_future(self._sleep(delay))
        stopper = asyncio.ensure_future(loop.stopping.wait())
        try:
            await asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (sleeper, stopper):
                t.cancel()
        return loop.stopping.is_set()

    def _name(self, loop: _Loop) -> str:
        name = checkpoint_name(loop.prefix, self._clock.now())
        previous, n = loop.last_name, 1
        base = name
        # Two in one millisecond (a frozen test clock): still distinct, still sorted.
        while previous is not None and name <= previous:
            name, n = f"{base}-{n}", n + 1
        return name

    async def _tick(self, loop: _Loop) -> None:
        name = self._name(loop)
        where = join_location(loop.root, name)
        loop.attempts += 1
        loop.last_name = name
        try:
            result = await self._checkpoint(loop.root, where)
        except Exception as exc:
            loop.failed += 1
            loop.consecutive += 1
            loop.last_error = error_body(exc, name=name, at=self._clock.now())
            log.warning(
                "periodic checkpoint %s failed (%d in a row); the next one still runs: %s",
                where,
                loop.consecutive,
                exc,
            )
            return
        loop.completed += 1
        loop.consecutive = 0
        loop.last_checkpoint_id = result.checkpoint_id
        loop.last_completed_at = self._clock.now()
        if loop.keep is None:
            return
        try:
            plan = await self._retain(loop.root, loop.keep)
        except Exception as exc:
            loop.last_retention_error = error_body(exc, at=self._clock.now())
            log.warning("retention under %s failed; checkpoints kept: %s", loop.root, exc)
            return
        loop.last_retention_error = None
        loop.deleted += len(plan.deleted_checkpoints)


# --- the assembler's scope ----------------------------------------------------


def episode_list(items: Iterable[Any]) -> list[EpisodeId]:
    """Episodes from EpisodeIds, capture keys, (rollout, attempt) pairs or
    {"rollout_id", "attempt"} objects; anything else is `InvalidRequest`."""
    if isinstance(items, str | bytes) or not isinstance(items, Iterable):
        raise InvalidRequest(f"expected a list of episodes, got {items!r}"[:300])
    out: list[EpisodeId] = []
    for e in items:
        if isinstance(e, EpisodeId):
            out.append(e)
        elif isinstance(e, str):
            out.append(EpisodeId.from_capture_key(e))
        elif isinstance(e, dict) and isinstance(e.get("rollout_id"), str):
            out.append(EpisodeId(e["rollout_id"], int(e.get("attempt", 0))))
        elif isinstance(e, tuple | list) and len(e) == 2:
            out.append(EpisodeId(str(e[0]), int(e[1])))
        else:
            raise InvalidRequest(f"not an episode: {e!r}"[:300])
    return out


class AssemblerScope:
    """The registered assembler's `method()`: the episodes it has in flight."""

    def __init__(self, handle: Any, method: str, timeout_s: float) -> None:
        self.handle = handle
        self.method = method
        self.timeout_s = timeout_s

    async def __call__(self) -> list[EpisodeId]:
        from coordination.reach.hosts import _unwrap_ray_error

        what = f"{self.method} of the assembler"
        try:
            items = await asyncio.wait_for(
                _awaited(getattr(self.handle, self.method).remote()), self.timeout_s
            )
        except TimeoutError:
            raise DeadlineExceeded(f"{what} did not answer in {self.timeout_s:g}s") from None
        except Exception as exc:
            raise _unwrap_ray_error(exc, what) from None
        return episode_list(items)


async def _awaited(ref: Any) -> Any:
    return await ref
