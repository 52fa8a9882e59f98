"""The restore side: the one restore a process may take, and its install.

A participant restores at most once, into a fresh process, and the install
of the read records may outlive the restore call that started it (a missed
deadline fails the call, not the install).  Retire and resume must wait for
such an install, so `Restores` remembers it.  The controller keeps the phase
machine, the lock and the restore's order of steps; this module holds the
restore's own state and its work on the participant and the store.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ray_ckpt.control.phase_machine import Phase
from ray_ckpt.control.timing import within
from ray_ckpt.control.wire import RestoreRequest
from ray_ckpt.errors import DeadlineExceeded, InvalidPhase
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.record import Record

if TYPE_CHECKING:
    from ray_ckpt.control.controller import ParticipantController


class Restores:
    """The restore's own state (once per process, the install in flight) and work."""

    def __init__(self, controller: ParticipantController) -> None:
        # Read at each call, not copied: the controller's participant and store
        # are public attributes a host or a test may replace.
        self._controller = controller
        # Set once an install ran and did not fail outright (it succeeded, or
        # outlived its deadline and may still be installing).
        self.restored_once = False
        self._install: asyncio.Future[list[EpisodeId]] | None = None

    async def read(self, req: RestoreRequest) -> tuple[Any, list[Record]]:
        """In a fresh process only: read this participant's records of the
        requested episodes (in a thread, inside the deadline)."""
        c = self._controller
        if self.restored_once or not c.participant.fresh():
            raise InvalidPhase(
                f"{c.kind}/{c.instance}: restore needs a fresh process that has "
                "served nothing and restored nothing"
            )
        wanted = {e.capture_key for e in req.episode_ids}
        return await within(
            c.clock,
            req,
            "restore read",
            asyncio.to_thread(
                c.store.read,
                req.checkpoint_dir,
                kind=c.kind,
                instance=c.instance,
                select=wanted.__contains__,
            ),
        )

    async def install(self, req: RestoreRequest, records: list[Record]) -> list[EpisodeId]:
        """Install `records`; a failure other than the deadline installed nothing."""
        c = self._controller
        # Shielded: an install that outlives the deadline keeps running (the
        # call fails); retire and resume wait for it, so admission never
        # reopens on half-installed state and a cleanup retire frees it all.
        install = asyncio.ensure_future(c.participant.install(records))
        self._install = install
        try:
            installed = await within(c.clock, req, "install", asyncio.shield(install))
        except DeadlineExceeded:
            self.restored_once = True
            raise
        self.restored_once = True
        return installed

    async def installed(self) -> None:
        """Wait for an install that outlived its restore call (its outcome is moot)."""
        if self._install is not None and not self._install.done():
            await asyncio.wait([self._install])


def restore_reply(manifest: Any, installed: list[EpisodeId]) -> dict[str, Any]:
    return {
        "phase": Phase.RESTORED.value,
        "source_checkpoint_id": getattr(manifest, "checkpoint_id", None),
        "restored": sorted(e.capture_key for e in installed),
    }
