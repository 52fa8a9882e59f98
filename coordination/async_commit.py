"""After an asynchronous checkpoint's resume: wait for durability, publish last.

`checkpoint(..., durability="async")` resumes the Gym once every participant
has captured its records (their commit replies are `pending`).  Here, off the
coordinator's lock, the same commit is sent again to each member: each reply
waits for that participant's write and carries its final manifest (or the
write's typed error).  Only when every one is durable is the Gym manifest
written (and `LATEST` pointed at it): the commit point, as in a synchronous
checkpoint, just later.  A failed write fails the pending checkpoint with the
participant's error and no Gym manifest is written; the previous complete
checkpoint stays `latest`.

A coordinator that dies meanwhile publishes nothing: the directory keeps the
participants' records without a Gym manifest, which `inspect` and `list`
call incomplete.  The next checkpoint waits for the one pending before it
(`PendingWrites.settle`), so `LATEST` never goes back in time.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from coordination.calls import coordination_failed
from coordination.checkpoint import manifest_bytes
from coordination.fanout import failure, fan_out
from coordination.hosts import Host
from coordination.replies import as_mapping, int_or_none
from coordination.results import DurableResult
from coordination.timeline import COORDINATOR_ROW
from ray_ckpt.errors import CheckpointError, InvalidRequest

if TYPE_CHECKING:
    from coordination.phase_driver import PhaseDriver

KEPT = 8


async def confirm_durable(
    driver: PhaseDriver,
    cid: str,
    checkpoint_dir: str,
    hosts: Sequence[Host],
    body: dict[str, Any],
    deadline_s: float,
) -> DurableResult:
    """Every member's write durable, then the Gym manifest; raises `CoordinationFailed`."""
    start = time.monotonic()
    deadline_ts = driver.clock.now() + deadline_s
    confirm = {**body, "deadline_ts": deadline_ts}
    started = driver.clock.now()
    out = await fan_out(
        hosts, "commit", lambda h: confirm, deadline_s + driver.timeouts.reply_grace_s
    )
    for key, seconds in out.timings.items():
        driver.timeline.span(
            cid, key, "durable", started, started + seconds, ok=key not in out.errors
        )
    if out.errors:
        raise coordination_failed("commit", cid, {k: failure(e) for k, e in out.errors.items()})
    manifests = [dict(as_mapping(r.get("manifest"))) for _, r in sorted(out.replies.items())]
    m_start = time.monotonic()
    publishing = driver.clock.now()
    try:
        await asyncio.to_thread(driver.manifest_writer, checkpoint_dir, cid, manifests)
    except Exception as exc:
        err = exc if isinstance(exc, CheckpointError) else CheckpointError(repr(exc))
        raise coordination_failed("commit", cid, {"gym-manifest": failure(err)}) from None
    await driver._write_latest(checkpoint_dir, cid)
    driver.timeline.span(cid, COORDINATOR_ROW, "publish", publishing, driver.clock.now())
    written = {k: manifest_bytes(r.get("manifest")) for k, r in out.replies.items()}
    return DurableResult(
        checkpoint_id=cid,
        checkpoint_dir=checkpoint_dir,
        durable_s=time.monotonic() - start,
        manifest_s=time.monotonic() - m_start,
        bytes=written,
        total_bytes=sum(written.values()),
        captured_bytes=sum(int_or_none(r.get("captured_bytes")) or 0 for r in out.replies.values()),
    )


class PendingWrites:
    """The asynchronous checkpoints not yet durable (and the last few that are)."""

    def __init__(self) -> None:
        self._tasks: OrderedDict[str, asyncio.Task[DurableResult]] = OrderedDict()

    def add(self, cid: str, task: asyncio.Task[DurableResult]) -> None:
        # Retrieved (the failure reported) by `durable()`; never "never retrieved".
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._tasks[cid] = task
        while len(self._tasks) > KEPT and next(iter(self._tasks.values())).done():
            self._tasks.popitem(last=False)

    async def durable(self, cid: str) -> DurableResult:
        task = self._tasks.get(cid)
        if task is None:
            raise InvalidRequest(
                f"no asynchronous checkpoint {cid!r}: this coordinator keeps the last {KEPT}"
            )
        return await asyncio.shield(task)

    async def settle(self) -> None:
        """Wait for every pending one (their outcome goes to their `durable()`)."""
        running = [t for t in self._tasks.values() if not t.done()]
        if running:
            await asyncio.wait(running)

    def running(self) -> list[str]:
        return [cid for cid, t in self._tasks.items() if not t.done()]

    async def aclose(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks.values()))
