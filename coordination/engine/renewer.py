"""Keeping the open checkpoint's leases alive while it stays open.

`LeaseRenewer` runs one background task per open checkpoint that renews
every participant's lease on a period, and sooner when the latest deadline
the driver sent is about to pass.  The driver reports each deadline it sends
(`raise_floor`) and starts/stops the task with the checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from coordination.engine.calls import reply_timeout
from coordination.engine.fanout import fan_out
from coordination.engine.host import Host
from coordination.engine.results import Timeouts
from ray_ckpt.clock import Clock
from ray_ckpt.errors import CheckpointError, StaleCoordinator

log = logging.getLogger(__name__)

# How often the renewer looks at the clock (it calls participants only when due).
_RENEW_POLL_S = 0.2


class LeaseRenewer:
    def __init__(
        self,
        clock: Clock,
        timeouts: Timeouts,
        *,
        open_id: Callable[[], str | None],
        hosts: Callable[[], list[Host]],
        stamp: Callable[[Host, Mapping[str, Any]], Mapping[str, Any]] | None = None,
        confirm: Callable[[], Awaitable[None]] | None = None,
        superseded: Callable[[StaleCoordinator], None] | None = None,
    ) -> None:
        self.clock = clock
        self.timeouts = timeouts
        # Read at each step, not captured: the driver's open checkpoint and
        # registered hosts change while the renewer runs.
        self._open_id = open_id
        self._hosts = hosts
        # The body as sent to one host (the coordinator's epoch added).
        self._stamp = stamp or (lambda _h, body: body)
        # Each period the coordinator's epoch is confirmed first: a
        # superseded coordinator renews nobody's lease, and `superseded`
        # is told once (the engine then aborts the open checkpoint).
        self._confirm = confirm
        self._superseded = superseded
        self._task: asyncio.Task[None] | None = None
        # The latest deadline sent in the open checkpoint: every participant's
        # lease runs at least to it plus its grace, whatever that grace is.
        self._lease_floor = 0.0

    def raise_floor(self, deadline_ts: float) -> None:
        self._lease_floor = max(self._lease_floor, deadline_ts)

    def start(self, cid: str) -> None:
        self.stop()
        self._lease_floor = 0.0
        self._task = asyncio.ensure_future(self._loop(cid))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _loop(self, cid: str) -> None:
        """Renew every `renew_every_s`, and always before the latest deadline we
        sent passes: a lease is only sure to last that long plus its grace, and
        the grace (each participant's setting) is not known here."""
        poll_s = min(_RENEW_POLL_S, self.timeouts.renew_every_s)
        margin_s = max(0.1 * self.timeouts.resume_s, _RENEW_POLL_S)
        last = self.clock.now()
        while self._open_id() == cid:
            await asyncio.sleep(poll_s)
            if self._open_id() != cid:
                return
            now = self.clock.now()
            floor_due = 0.0 < self._lease_floor <= now + margin_s
            if floor_due or now - last >= self.timeouts.renew_every_s:
                last = now
                if self._confirm is not None:
                    try:
                        await self._confirm()
                    except StaleCoordinator as exc:
                        log.warning("lease renewals of %s stopped: %s", cid, exc)
                        if self._superseded is not None:
                            self._superseded(exc)
                        return
                with contextlib.suppress(CheckpointError):
                    await self.renew()

    async def renew(self) -> dict[str, float | None]:
        """Extend every lease of the open checkpoint (publishing takes long)."""
        cid = self._open_id()
        if cid is None:
            return {}
        deadline_ts = self.clock.now() + self.timeouts.resume_s
        self.raise_floor(deadline_ts)
        body = {"checkpoint_id": cid, "deadline_ts": deadline_ts}
        timeout = reply_timeout(self.clock, self.timeouts, deadline_ts)
        out = await fan_out(self._hosts(), "renew", lambda h: self._stamp(h, body), timeout)
        for key, err in out.errors.items():
            log.warning("renew of %s at %s failed: %s", cid, key, err)
        return {k: r.get("lease_expires_at") for k, r in out.replies.items()}
