"""The participant a multi-worker host's engine drives: all its workers as one.

The engine's hooks are synchronous where they must be cheap (`ready`,
`report`, `close_admission`): they read the table of the workers' latest
reports, and a close or open goes out to every worker as a task whose
replies land in the table (the engine's readiness wait is woken as
reports arrive).  The asynchronous hooks fan out and fail whole: an export
with any worker lost, unreported or failing raises, so a checkpoint never
holds a part of a server.  Restored records are installed into the worker
their rollout routes to (`routing.owner_index` over today's worker count,
whatever the count was at the checkpoint).  An install fails whole: if any
worker fails (or is lost before the install ends), every worker it reached
drops its part, held results included.

A restored episode lives in one worker.  If that worker is lost after the
install, the episode's state is gone although the restore reported it
restored: its next attempt is fenced at once on every worker (the fence the
replacement starts with included), so a late call of it is refused
`stale_attempt` and never silently starts over, and until the restore's
resume the loss is kept (`restored_lost`), for the engine to refuse that
resume (`RestoredStateLost`) unless those attempts were retired meanwhile.

A server declared stateless has nothing to export and nothing to park: its
workers are closed and reopened (so they drain), but it is always ready and
no worker of it ever blocks a checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from ray_ckpt.errors import InvalidCheckpointState, ParticipantUnavailable
from ray_ckpt.identity import EpisodeId, check_record_key, is_result_key
from ray_ckpt.reports import Blocker, PrepareReport
from ray_ckpt.steps.retire_marks import retire_scope
from ray_ckpt.storage.records.record import Record
from ray_ckpt.workers.pool import WorkerPool
from ray_ckpt.workers.receipts import WorkerReceipts
from ray_ckpt.workers.routing import owner_index
from ray_ckpt.workers.tracking import LOST, WorkerTable, worker_id

log = logging.getLogger(__name__)

# A restore closes admission just before it installs: how long the install
# waits for every worker to confirm that close.
INSTALL_REPORT_WAIT_S = 10.0


def _order(episode: EpisodeId) -> tuple[str, int]:
    return (episode.rollout_id, episode.attempt)


async def _logged(coro: Any, kind: str) -> None:
    """A fire-and-forget fan-out: a failure is logged (a lost worker is already
    a blocker in the table), never an unretrieved task error."""
    try:
        await coro
    except Exception:
        log.warning("%s: worker fan-out failed", kind, exc_info=True)


class WorkersParticipant:
    def __init__(self, kind: str, pool: WorkerPool, *, stateless: bool = False) -> None:
        self.kind = kind
        self.pool = pool
        self.table: WorkerTable = pool.table
        self.stateless = stateless
        self._notify: Callable[[], None] = lambda: None
        self._tasks: set[asyncio.Task[None]] = set()
        # The results the workers hold, for ack and collect (`receipt_ops`).
        self.worker_receipts = WorkerReceipts(pool)
        # The restored attempts each worker holds (installed, not yet retired
        # or forgotten), and those lost with their worker before the restore's
        # resume (worker ID -> attempts).
        self._restored: dict[str, set[EpisodeId]] = {}
        self._lost_restored: dict[str, set[EpisodeId]] = {}
        pool.on_lost = self._worker_lost

    def bind(self, notify: Callable[[], None]) -> None:
        self._notify = notify
        self.pool.changed = notify

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(_logged(coro, self.kind))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- admission (a new generation each time) -----------------------------------
    def close_admission(self) -> None:
        generation = self.table.close()
        self._spawn(self.pool.tell_all("close", {"generation": generation}))
        self._notify()

    def open_admission(self) -> None:
        # The restore's resume (or its lapsed lease) is past: what it lost is
        # fenced; nobody asks any more.
        self._lost_restored.clear()
        generation = self.table.open()
        self._spawn(self.pool.tell_all("open", {"generation": generation}))
        self._notify()

    # --- readiness -------------------------------------------------------------------
    def ready(self) -> bool:
        return True if self.stateless else self.table.ready()

    def report(self, limit: int) -> PrepareReport:
        if self.stateless:
            return PrepareReport(ready=True, counts={"workers": self.table.expected})
        ours = [Blocker(key=k, state="worker") for k in self.table.blockers()]
        theirs: list[Blocker] = []
        count = len(ours)
        restarts: list[str] = []
        for report in self.table.current().values():
            theirs.extend(msgspec.convert(b, Blocker) for b in report.blockers)
            count += report.blocker_count
            restarts.extend(report.restarts)
        return PrepareReport(
            ready=self.ready(),
            blockers=(ours + theirs)[:limit],
            blocker_count=count,
            counts={"workers": self.table.expected, "workers_reported": len(self.table.current())},
            restarts=restarts,
        )

    def live_executions(self) -> int:
        return self.table.live()

    def fresh(self) -> bool:
        return self.table.fresh()

    def retiring(self) -> int:
        return sum(r.retiring for r in self.table.current().values())

    # --- the checkpoint's work ----------------------------------------------------------
    def _require_complete(self, what: str) -> None:
        blockers = self.table.blockers()
        if blockers:
            raise ParticipantUnavailable(f"{self.kind}: cannot {what}: {', '.join(blockers)}")

    async def export(self, scope: Sequence[EpisodeId] | None) -> list[Record]:
        if self.stateless:
            return []
        self._require_complete("export")
        body = {"scope": None if scope is None else list(scope)}
        replies = await self.pool.call_all("export", body)
        # A worker lost while exporting fails the export even if its call
        # raced to an answer: the table saw the loss.
        self._require_complete("export")
        records: list[Record] = []
        for reply in replies.values():
            records.extend(msgspec.convert(reply["records"], list[Record]))
        return records

    def _by_owner(self, records: Sequence[Record]) -> dict[str, list[Record]]:
        groups: dict[str, list[Record]] = {}
        for record in records:
            # A held result (`result:<capture key>`) goes with its rollout.
            rollout = check_record_key(record.key).rollout_id
            index = owner_index(rollout, self.table.expected)
            groups.setdefault(worker_id(index), []).append(record)
        return groups

    async def _reported(self, timeout_s: float = INSTALL_REPORT_WAIT_S) -> None:
        """Until every worker reported at this generation (a restore has just
        closed admission); a lost worker fails at once."""
        try:
            async with asyncio.timeout(timeout_s):
                while self.table.unreported() and not any(
                    b.startswith(LOST) for b in self.table.blockers()
                ):
                    await self.pool.wait_change()
        except TimeoutError:
            pass  # named by the check that follows

    async def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        if self.stateless and records:
            raise InvalidCheckpointState(f"{self.kind} is stateless: it installs no records")
        await self._reported()
        self._require_complete("install")
        groups = self._by_owner(records)
        by_worker: dict[str, list[EpisodeId]] = {}
        try:
            results = await asyncio.gather(
                *(self.pool.call(w, "install", {"records": g}) for w, g in groups.items()),
                return_exceptions=True,
            )
            for wid, result in zip(groups, results, strict=True):
                if isinstance(result, BaseException):
                    raise result
                by_worker[wid] = msgspec.convert(result["installed"], list[EpisodeId])
            # A worker lost after it answered: what it installed is gone.
            self._require_complete("install")
        except BaseException:
            await self._uninstall(groups)
            raise
        for wid, episodes in by_worker.items():
            self._restored.setdefault(wid, set()).update(episodes)
        for record in records:
            if not is_result_key(record.key):  # a held result is no attempt
                self._mark(record.episode_id)
        return [e for episodes in by_worker.values() for e in episodes]

    async def _uninstall(self, groups: dict[str, list[Record]]) -> None:
        """A failed install leaves nothing on any worker it reached (the
        engine's `delete_restored(())` frees episodes, not held results)."""
        wids = sorted(groups)
        results = await asyncio.gather(
            *(self.pool.call(w, "uninstall", {"keys": [r.key for r in groups[w]]}) for w in wids),
            return_exceptions=True,
        )
        for wid, result in zip(wids, results, strict=True):
            if isinstance(result, BaseException):
                # A lost worker lost its part with it; any other failure is logged.
                log.warning("%s: undoing the install on %s failed: %r", self.kind, wid, result)

    # --- restored state lost with its worker ------------------------------------------
    def _worker_lost(self, wid: str) -> None:
        """`wid`'s process is gone, and the restored attempts it held with it:
        fence them everywhere before a replacement can say hello."""
        gone = self._restored.pop(wid, set())
        if not gone:
            return
        for episode in gone:
            self._mark(episode)
        if self.table.closed:
            self._lost_restored.setdefault(wid, set()).update(gone)
        log.warning(
            "%s: worker %s lost restored attempts %s; fenced",
            self.kind,
            wid,
            sorted(e.capture_key for e in gone),
        )
        body = {"episodes": [msgspec.to_builtins(e) for e in sorted(gone, key=_order)]}
        self._spawn(self.pool.call_all("mark", body))

    def restored_lost(self) -> dict[str, list[str]]:
        """The restored attempts lost with their worker since the install and
        not retired since, by worker ID (capture keys): the restore's resume
        is refused while any remain."""
        return {
            wid: sorted(e.capture_key for e in gone)
            for wid, gone in sorted(self._lost_restored.items())
            if gone
        }

    def _drop_restored(self, covered: Callable[[EpisodeId], bool]) -> None:
        for held in (*self._restored.values(), *self._lost_restored.values()):
            held.difference_update([e for e in held if covered(e)])

    async def retire(self, episode_ids: Sequence[EpisodeId]) -> list[str]:
        for episode in episode_ids:
            self._mark(episode)
        # Retired attempts are over: their loss no longer refuses a resume.
        self._drop_restored(retire_scope(episode_ids))
        replies = await self.pool.call_all("retire", {"episodes": list(episode_ids)})
        return sorted({k for reply in replies.values() for k in reply["keys"]})

    async def delete_restored(self, keep: Sequence[EpisodeId]) -> list[str]:
        replies = await self.pool.call_all("delete_restored", {"keep": list(keep)})
        freed = sorted({k for reply in replies.values() for k in reply["keys"]})
        gone = set(freed)
        self._drop_restored(lambda e: e.capture_key in gone)
        return freed

    def forget(self, rollout_ids: list[str]) -> None:
        for rollout in rollout_ids:
            self.pool.marks.pop(rollout, None)
        forgotten = set(rollout_ids)
        self._drop_restored(lambda e: e.rollout_id in forgotten)
        self._spawn(self.pool.call_all("forget", {"rollouts": rollout_ids}))

    async def park_exported(self, records: Sequence[Record]) -> None:
        groups = self._by_owner(records)
        await asyncio.gather(
            *(self.pool.call(w, "park", {"records": group}) for w, group in groups.items())
        )

    def _mark(self, episode: EpisodeId) -> None:
        marks = self.pool.marks
        marks[episode.rollout_id] = max(marks.get(episode.rollout_id, -1), episode.attempt)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
