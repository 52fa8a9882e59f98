"""The engine's waits against the clock: a call's deadline, readiness, the lease.

Every control call runs inside its absolute deadline (`within`); prepare
waits for the participant to become ready (`ReadinessWait`); and a background
task resumes by itself when the coordinator stops renewing (`LeaseWatcher`).
They are the timing mechanics only, given what they watch as callables:
what to do when a deadline passes or a lease runs out stays in the
engine, under its lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ray_ckpt.clock import Clock
from ray_ckpt.control.wire import CheckpointRequest
from ray_ckpt.errors import CheckpointError, DeadlineExceeded

# The engine's logger, not this module's: moving the code out of the
# engine must not move its errors away from the operators' log filters.
log = logging.getLogger("ray_ckpt.control.engine")
T = TypeVar("T")

# The readiness wait re-checks at least this often even without a notify.
_READY_POLL_S = 1.0


async def within(clock: Clock, req: CheckpointRequest, what: str, aw: Awaitable[T]) -> T:
    """Run `aw` inside the request's remaining time, or `deadline_exceeded`."""
    remaining = req.remaining(clock.now())
    try:
        async with asyncio.timeout(remaining):
            return await aw
    except TimeoutError:
        raise DeadlineExceeded(f"{what} of {req.checkpoint_id} missed its deadline") from None


class ReadinessWait:
    """Prepare's wait for the participant to become ready, woken by `notify`."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()

    def notify(self) -> None:
        self._changed.set()

    async def wait(self, done: Callable[[], bool], deadline_ts: float, clock: Clock) -> None:
        """Return once `done()` (ready, or the checkpoint changed) or the
        deadline passed (the caller reads which; this never raises on the
        deadline).  `done` is checked at each notify, and at least every
        `_READY_POLL_S` without one."""
        while True:
            self._changed.clear()
            if done():
                return
            left = deadline_ts - clock.now()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, _READY_POLL_S)):
                    await self._changed.wait()


class LeaseWatcher:
    """Calls `check` (the engine's `check_lease`) soon after the lease may
    have expired; `expires_in` says in how many seconds it will (None: no lease)."""

    def __init__(
        self, check: Callable[[], Awaitable[bool]], expires_in: Callable[[], float | None]
    ) -> None:
        self._check = check
        self._expires_in = expires_in
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start watching on the running loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _watch(self) -> None:
        while True:
            left = self._expires_in()
            wait = 0.5 if left is None else min(max(left, 0.01), 0.5)
            await asyncio.sleep(wait)
            try:
                await self._check()
            except CheckpointError:
                log.exception("lease check failed")
