"""The controller's waits against the clock: a call's deadline, readiness, the lease.

Every control call runs inside its absolute deadline (`within`); prepare
waits for the participant to become ready (`ReadinessWait`); and a background
task resumes by itself when the coordinator stops renewing (`LeaseWatcher`).
They are split from the controller because they are the timing mechanics
only: what to do when a deadline passes or a lease runs out stays in the
controller, under its lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

from ray_ckpt.clock import Clock
from ray_ckpt.control.wire import CheckpointRequest
from ray_ckpt.errors import CheckpointError, DeadlineExceeded

if TYPE_CHECKING:
    from ray_ckpt.control.controller import ParticipantController

# The controller's logger, not this module's: moving the code out of the
# controller must not move its errors away from the operators' log filters.
log = logging.getLogger("ray_ckpt.control.controller")
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

    def __init__(self, controller: ParticipantController) -> None:
        # Read at each check, not copied: the controller's clock, state and
        # participant are public attributes.
        self._controller = controller
        self._changed = asyncio.Event()

    def notify(self) -> None:
        self._changed.set()

    async def wait(self, req: CheckpointRequest) -> None:
        """Return once ready, the checkpoint changed, or the deadline passed
        (the caller reads which; this never raises on the deadline)."""
        c = self._controller
        cid = req.checkpoint_id
        while True:
            self._changed.clear()
            if c.state.checkpoint_id != cid or c.participant.ready():
                return
            left = req.deadline_ts - c.clock.now()
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, _READY_POLL_S)):
                    await self._changed.wait()


class LeaseWatcher:
    """Calls the controller's `check_lease` soon after the lease may have expired."""

    def __init__(self, controller: ParticipantController) -> None:
        # Read at each tick, not copied: the controller's clock and state are public.
        self._controller = controller
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
        c = self._controller
        while True:
            expires = c.state.lease_expires_at
            wait = 0.5 if expires is None else min(max(expires - c.clock.now(), 0.01), 0.5)
            await asyncio.sleep(wait)
            try:
                await c.check_lease()
            except CheckpointError:
                log.exception("lease check failed")
