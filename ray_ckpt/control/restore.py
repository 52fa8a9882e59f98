"""The restore side: the one restore a process may take, and its install.

A participant restores at most once, into a fresh process, and the install
of the read records may outlive the restore call that started it (a missed
deadline or a cancelled call fails the call, not the install).  `Restores`
remembers that install (`Install`) so that:

- a retried restore with the same ID joins it and answers its result;
- retire and resume wait for it, so admission never reopens while it runs;
- a lapsed lease cancels it if it still runs and frees what it installed,
  unless a restore call already answered its result (then the coordinator
  knows the state and retires or claims it);
- an install that raised leaves nothing installed (`settle`).

An install that succeeds raises the retire marks of the attempts it
replaced (attempt N of each rollout when it installs N + 1), so a late data
call of an older attempt is refused `stale_attempt` until `forget`.

The restore's resume first asks the participant whether it is still whole
(`check_whole`): a multi-worker participant that lost a worker since the
install lost the episodes that worker held, so the restore that reported
them restored must fail, all or nothing, rather than reopen admission and
let them start over silently.

Records may carry attachments (`Record.attachments`): the read verifies
them as local files, downloading those a remote store holds into a
temporary folder of this restore's (`Downloads`).  The folder lives until
the install ends, succeeded or failed (the participant must copy what it
keeps), or until a read that failed or was given up ends.

The engine keeps the phase machine, the lock and the restore's order of
steps; this module holds the restore's own state and its work on the
participant and the store.  `Restores` is given the participant and the
retire marks' `fence` once; the store and the clock at each call, because
they are the engine's replaceable attributes (a test swaps the store).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ray_ckpt.clock import Clock
from ray_ckpt.control.phase_machine import Phase
from ray_ckpt.control.protocol import Participant
from ray_ckpt.control.timing import within
from ray_ckpt.control.wire import RestoreRequest
from ray_ckpt.errors import (
    CheckpointConflict,
    CheckpointError,
    InvalidCheckpointState,
    InvalidPhase,
    InvalidRequest,
    ParticipantUnavailable,
    RestoredStateLost,
)
from ray_ckpt.identity import EpisodeId, is_result_key
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.seam import RecordStore

# The engine's logger, not this module's: moving the code out of the
# engine must not move its warnings away from the operators' log filters.
log = logging.getLogger("ray_ckpt.control.engine")

T = TypeVar("T")


class Downloads:
    """The temporary folder one restore's read downloads attachments into.

    Removed by whichever ends last of the read's thread and its caller when
    the read fails or the caller gives up on it (a missed deadline leaves
    the thread running, and a folder removed under it would be refilled);
    after a read that succeeded, by the install that uses it (`remove`)."""

    def __init__(self) -> None:
        try:
            self.path = tempfile.mkdtemp(prefix="ray-ckpt-restore-")
        except OSError as exc:
            raise ParticipantUnavailable(
                f"no temporary folder for the restore's attachments: {exc}"
            ) from exc
        self._lock = threading.Lock()
        self._finished = False
        self._abandoned = False

    def run(self, read: Callable[[str], T]) -> T:
        """`read(folder)` on the read's thread; the folder goes if it raises."""
        try:
            return read(self.path)
        except BaseException:
            self.remove()
            raise
        finally:
            with self._lock:
                self._finished = True
                abandoned = self._abandoned
            if abandoned:
                self.remove()

    def abandon(self) -> None:
        """The caller gives up on the read: the folder goes once it ends."""
        with self._lock:
            self._abandoned = True
            finished = self._finished
        if finished:
            self.remove()

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@dataclass
class Install:
    """One restore's install, which may outlive the call that started it."""

    checkpoint_id: str
    checkpoint_dir: str
    episode_ids: tuple[EpisodeId, ...]
    manifest: Any
    task: asyncio.Task[list[EpisodeId]]
    # A restore call answered its result: the coordinator knows the state.
    answered: bool = False

    def check_same(self, req: RestoreRequest) -> None:
        """A retry must name this install's directory and episodes."""
        if (self.checkpoint_dir, self.episode_ids) != (req.checkpoint_dir, tuple(req.episode_ids)):
            raise CheckpointConflict(
                f"restore of {req.checkpoint_id} already runs with another directory or scope"
            )

    def failed(self) -> bool:
        """Finished by raising (a cancelled install counts: it may be partial)."""
        return self.task.done() and (self.task.cancelled() or self.task.exception() is not None)


class Restores:
    """The restore's own state (once per process, the install in flight) and work."""

    def __init__(
        self,
        participant: Participant,
        *,
        instance: str,
        fence: Callable[[EpisodeId], None],
    ) -> None:
        self._participant = participant
        self._kind = participant.kind
        self._instance = instance
        # Refuses attempts up to the one given (`RetiredAttempts.fence`).
        self._fence = fence
        # Set once an install started, cleared only when one failed and its
        # leftovers were freed (then the process may restore again).
        self.restored_once = False
        self.current: Install | None = None
        # The downloads of a read whose install has not begun (`begin` takes them).
        self._staged: Downloads | None = None

    def pending(self, checkpoint_id: str) -> Install | None:
        """The install of `checkpoint_id` no call has answered yet, if any."""
        install = self.current
        if install is None or install.checkpoint_id != checkpoint_id or install.answered:
            return None
        return install

    async def read(
        self, req: RestoreRequest, store: RecordStore, clock: Clock
    ) -> tuple[Any, list[Record]]:
        """In a fresh process only: read this participant's records of the
        requested episodes (in a thread, inside the deadline)."""
        if self.restored_once or not self._participant.fresh():
            raise InvalidPhase(
                f"{self._kind}/{self._instance}: restore needs a fresh process that has "
                "served nothing and restored nothing"
            )
        wanted = {e.capture_key for e in req.episode_ids}
        self._drop_staged()  # a read whose install never began (the engine failed between)
        downloads = Downloads()

        def read(folder: str) -> tuple[Any, list[Record]]:
            return store.read(
                req.checkpoint_dir,
                kind=self._kind,
                instance=self._instance,
                # Held results (completion receipts) come back whatever the
                # episodes asked: they were finished, not in any scope.
                select=lambda key: key in wanted or is_result_key(key),
                attachments_dir=folder,
            )

        try:
            got = await within(clock, req, "restore read", asyncio.to_thread(downloads.run, read))
        except BaseException:
            downloads.abandon()
            raise
        self._staged = downloads
        return got

    def _drop_staged(self) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.remove()

    def begin(self, req: RestoreRequest, manifest: Any, records: list[Record]) -> Install:
        """Start installing `records` as a task of its own: a missed deadline
        or a cancelled call fails the call, never the install."""
        downloads, self._staged = self._staged, None
        task = asyncio.ensure_future(self._install_and_mark(records, downloads))
        # Its outcome is read by whoever settles it, maybe no one (the host
        # stops first): never let asyncio log it as an unretrieved error.
        task.add_done_callback(_retrieve)
        if downloads is not None:
            # Also when it is cancelled before it ever ran (its own `finally`
            # removes them as soon as the install ends otherwise).
            task.add_done_callback(lambda _task: downloads.remove())
        self.current = Install(
            req.checkpoint_id, req.checkpoint_dir, tuple(req.episode_ids), manifest, task
        )
        self.restored_once = True
        return self.current

    async def _install_and_mark(
        self, records: Sequence[Record], downloads: Downloads | None
    ) -> list[EpisodeId]:
        try:
            try:
                replaced = [r.episode_id for r in records if not is_result_key(r.key)]
            except InvalidRequest as exc:
                raise InvalidCheckpointState(f"record key: {exc.detail}") from None
            installed = await self._participant.install(records)
        finally:
            # Installed or not, nothing reads the downloaded attachments now.
            if downloads is not None:
                downloads.remove()
        # Attempt N + 1 is installed: attempts <= N of those rollouts are over
        # here, as if retired (a late step of attempt N must not be served
        # from the fresh, empty state of this process).
        for episode in replaced:
            self._fence(episode)
        return installed

    def failure(self, install: Install) -> CheckpointError:
        """The typed error of an install that raised: a hook's own typed error
        stands; anything else (a TypeError from a user's setstate) is bad
        checkpoint state, which a retry cannot heal, never `unavailable`."""
        if install.task.cancelled():
            return InvalidCheckpointState(
                f"{self._kind}/{self._instance}: install of {install.checkpoint_id} was cancelled"
            )
        exc = install.task.exception()
        if isinstance(exc, CheckpointError):
            return exc
        return InvalidCheckpointState(
            f"{self._kind}/{self._instance}: install of {install.checkpoint_id} failed: "
            f"{type(exc).__name__}: {exc}"
        )

    async def settle(self) -> None:
        """After the install ended: if it raised, free whatever it left and
        let the process restore again (nothing stays installed)."""
        install = self.current
        if install is None or not install.failed():
            return
        self.current = None
        await self._free_restored(install)
        self.restored_once = False

    async def abandon(self) -> None:
        """A lapsed lease: stop an install no call answered and free its state.

        Waits for the cancelled install to end before returning, so the caller
        reopens admission only once nothing installs any more.
        """
        install, self.current = self.current, None
        if install is None:
            return
        if not install.task.done():
            install.task.cancel()
        await asyncio.wait([install.task])
        if install.answered and not install.failed():
            return
        await self._free_restored(install)

    async def _free_restored(self, install: Install) -> None:
        try:
            freed = await self._participant.delete_restored(())
        except Exception:
            # Best effort: the participant still resumes; a retire can free it.
            log.warning(
                "%s/%s: freeing the state of install %s failed",
                self._kind,
                self._instance,
                install.checkpoint_id,
                exc_info=True,
            )
            return
        if freed:
            log.warning(
                "%s/%s: dropped restored state of %s: %s",
                self._kind,
                self._instance,
                install.checkpoint_id,
                freed,
            )

    def check_whole(self) -> None:
        """Before the restore's resume: refuse it (`RestoredStateLost`) if the
        participant lost installed state since the install and nobody
        retired it since.  The optional hook `restored_lost()` answers, by
        part lost (a worker), the capture keys of the attempts that went."""
        hook = getattr(self._participant, "restored_lost", None)
        lost: dict[str, list[str]] = hook() if hook is not None else {}
        if lost:
            named = "; ".join(f"{part}: {', '.join(keys)}" for part, keys in lost.items())
            raise RestoredStateLost(
                f"{self._kind}/{self._instance}: restored state lost since the install ({named}); "
                "those episodes cannot continue: retire them and start them over"
            )

    def end(self) -> None:
        """The restore was resumed: it is over, and no retry may join it."""
        self.current = None

    async def installed(self) -> None:
        """Wait for an install that outlived its restore call (its outcome is moot)."""
        install = self.current
        if install is not None and not install.task.done():
            await asyncio.wait([install.task])

    async def aclose(self) -> None:
        self._drop_staged()
        install = self.current
        if install is not None and not install.task.done():
            install.task.cancel()
            with contextlib.suppress(BaseException):
                await install.task


def _retrieve(task: asyncio.Task[list[EpisodeId]]) -> None:
    if not task.cancelled():
        task.exception()


def restore_reply(manifest: Any, installed: list[EpisodeId]) -> dict[str, Any]:
    return {
        "phase": Phase.RESTORED.value,
        "source_checkpoint_id": getattr(manifest, "checkpoint_id", None),
        "restored": sorted(e.capture_key for e in installed),
    }
