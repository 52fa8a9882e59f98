"""`CoordinatorCore`: every coordinated operation, without Ray.

The `Coordinator` actor wraps one of these and adds only Ray concerns
(discovery by name, recovery when Ray restarts it), so this logic is
unit-tested deterministically with fake hosts.  One operation runs at a time;
`renew` and `status` may run beside any of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from coordination.fanout import failure
from coordination.hosts import Host
from coordination.journal import JournalEntry
from coordination.order import Member, forget_groups, restore_groups, retire_groups
from coordination.phase_driver import PhaseDriver, _episode, _failed, new_id
from coordination.results import (
    CheckpointResult,
    CommitResult,
    CoordinatorStatus,
    ForgetResult,
    ParticipantStatus,
    PrepareResult,
    RestoreResult,
    ResumeResult,
    RetireResult,
)
from ray_ckpt.errors import (
    CheckpointConflict,
    CheckpointError,
    CoordinationFailed,
    InvalidCheckpointState,
    InvalidPhase,
    InvalidRequest,
)
from ray_ckpt.identity import EpisodeId

log = logging.getLogger(__name__)

# checkpoint dir → (source checkpoint ID, {(kind, instance)} listed in its Gym manifest)
ManifestReader = Callable[[str], tuple[str | None, set[tuple[str, str]]]]


def read_listed(checkpoint_dir: str) -> tuple[str | None, set[tuple[str, str]]]:
    from ray_ckpt.storage import read_gym_manifest

    gym = read_gym_manifest(checkpoint_dir)
    return gym.checkpoint_id, {(e.kind, e.instance) for e in gym.participants}


class CoordinatorCore(PhaseDriver):
    def __init__(self, *, manifest_reader: ManifestReader = read_listed, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.manifest_reader = manifest_reader

    # --- checkpoint ------------------------------------------------------------
    async def prepare(self, deadline_s: float | None = None) -> PrepareResult:
        """Open a checkpoint: pause controllers, prepare group by group."""
        async with self.lock:
            return await self._prepare(deadline_s)

    async def commit(
        self,
        checkpoint_dir: str,
        scope: Sequence[EpisodeId] | None = None,
        *,
        stop: bool = False,
        deadline_s: float | None = None,
    ) -> CommitResult:
        """Commit the open checkpoint everywhere, then write the Gym manifest."""
        async with self.lock:
            return await self._commit(checkpoint_dir, scope, stop=stop, deadline_s=deadline_s)

    async def resume(self, deadline_s: float | None = None) -> ResumeResult:
        """Close (or abort) the open checkpoint; idempotent."""
        async with self.lock:
            return await self._resume(deadline_s)

    async def renew(self) -> dict[str, float | None]:
        return await self._renew()

    async def checkpoint(
        self,
        checkpoint_dir: str,
        scope: Sequence[EpisodeId] | None = None,
        *,
        resume: bool = True,
        stop: bool = False,
        prepare_s: float | None = None,
        commit_s: float | None = None,
    ) -> CheckpointResult:
        """prepare → commit → Gym manifest → resume (unless kept open to publish)."""
        async with self.lock:
            start = time.monotonic()
            prepared = await self._prepare(prepare_s)
            committed = await self._commit(checkpoint_dir, scope, stop=stop, deadline_s=commit_s)
            resumed = await self._resume() if resume else None
        timings: dict[str, dict[str, float]] = {}
        for op, table in (("prepare", prepared.timings), ("commit", committed.timings)):
            for key, seconds in table.items():
                timings.setdefault(key, {})[op] = seconds
        return CheckpointResult(
            checkpoint_id=prepared.checkpoint_id,
            checkpoint_dir=checkpoint_dir,
            total_s=time.monotonic() - start,
            prepare_s=prepared.seconds,
            commit_s=committed.seconds,
            manifest_s=committed.manifest_s,
            resume_s=resumed.seconds if resumed is not None else None,
            timings=timings,
            bytes=committed.bytes,
            total_bytes=sum(committed.bytes.values()),
            episode_ids=committed.episode_ids,
            restarts=prepared.restarts,
            resume_failures=resumed.failures if resumed is not None else {},
        )

    # --- restore ---------------------------------------------------------------
    async def restore(
        self,
        checkpoint_dir: str,
        episode_ids: Iterable[EpisodeId],
        *,
        resume: bool = True,
        deadline_s: float | None = None,
    ) -> RestoreResult:
        """All or nothing: every participant restores, or none keeps what it installed."""
        episodes = list(episode_ids)
        async with self.lock:
            if self.open is not None:
                raise CheckpointConflict(f"checkpoint {self.open.checkpoint_id} is open")
            members = self._members()
            if not members:
                raise InvalidRequest("no participants are registered")
            start = time.monotonic()
            try:
                source_id, listed = await asyncio.to_thread(self.manifest_reader, checkpoint_dir)
            except CheckpointError as exc:
                raise CoordinationFailed(
                    f"restore from {checkpoint_dir}: {exc}",
                    operation="restore",
                    failures={"gym-manifest": failure(exc)},
                ) from None
            # Checked before touching anyone: a participant the checkpoint does
            # not list would start empty while the others continue.
            missing = sorted(m.key for m in members if (m.kind, m.name) not in listed)
            if missing:
                err = InvalidCheckpointState(f"not listed in the Gym manifest of {checkpoint_dir}")
                raise _failed("restore", source_id or "?", {k: failure(err) for k in missing})
            cid = new_id("restore")
            deadline_s = self.timeouts.restore_s if deadline_s is None else deadline_s
            deadline_ts = self.clock.now() + deadline_s
            keys = [e.capture_key for e in episodes]
            self._record(
                JournalEntry(
                    checkpoint_id=cid,
                    phase="restoring",
                    op="restore",
                    checkpoint_dir=checkpoint_dir,
                    episode_ids=keys,
                )
            )
            body = {
                "checkpoint_id": cid,
                "deadline_ts": deadline_ts,
                "checkpoint_dir": checkpoint_dir,
                "episode_ids": [_episode(e) for e in episodes],
            }
            out = await self._group(restore_groups(members)[0], "restore", body, deadline_ts)
            if out.errors:
                await self._undo_restore(cid, episodes, deadline_ts)
                raise _failed("restore", cid, {k: failure(e) for k, e in out.errors.items()})
            entry = self.open
            assert entry is not None
            entry.phase = "restored"
            self._record(entry)
            if resume:
                await self.resume_everyone(cid)
            return RestoreResult(
                checkpoint_id=cid,
                source_checkpoint_id=source_id,
                checkpoint_dir=checkpoint_dir,
                total_s=time.monotonic() - start,
                timings=out.timings,
                restored={k: list(r.get("restored", [])) for k, r in out.replies.items()},
                resumed=resume,
            )

    async def _undo_restore(
        self, cid: str, episodes: Sequence[EpisodeId], deadline_ts: float
    ) -> None:
        """Retire the next attempts, then resume everyone; continue past failures.

        Retired everywhere, not only where the install finished: a restore that
        timed out may still install, and the same mark everywhere tells the
        controller one attempt number to start those rollouts over with.
        """
        cleanup_ts = max(deadline_ts, self.clock.now() + self.timeouts.cleanup_min_s)
        if episodes:
            body = {
                "checkpoint_id": cid,
                "deadline_ts": cleanup_ts,
                "episode_ids": [_episode(e.next()) for e in episodes],
            }
            for group in retire_groups(self._members()):
                out = await self._group(group, "retire", body, cleanup_ts)
                for key, err in out.errors.items():
                    log.warning("cleanup retire of %s at %s failed: %s", cid, key, err)
        await self.resume_everyone(cid)

    # --- retire / forget ---------------------------------------------------------
    def _idle_operation_id(self, op: str) -> str:
        entry = self.open
        if entry is None:
            # Fresh every time: any resumed ID is stale at every participant.
            return new_id(op)
        if entry.op == "restore" and entry.phase == "restored":
            return entry.checkpoint_id  # right after a restore the participants expect its ID
        raise InvalidPhase(
            f"checkpoint {entry.checkpoint_id} is open ({entry.phase}): resume it, then {op}"
        )

    async def _in_retire_order(
        self,
        op: str,
        field: str,
        values: list[dict[str, Any]] | list[str],
        deadline_s: float | None,
    ) -> tuple[str, dict[str, list[str]]]:
        oid = self._idle_operation_id(op)
        deadline_ts = self.clock.now() + (
            self.timeouts.retire_s if deadline_s is None else deadline_s
        )
        body = {"checkpoint_id": oid, "deadline_ts": deadline_ts, field: values}
        reply_field = "retired" if op == "retire" else "forgotten"
        done: dict[str, list[str]] = {}
        groups = forget_groups if op == "forget" else retire_groups
        for group in groups(self._members()):
            out = await self._group(group, op, body, deadline_ts)
            done.update({k: list(r.get(reply_field, [])) for k, r in out.replies.items()})
            if out.errors:
                # Callers before callees: stop here; the call is idempotent, retry it.
                raise _failed(op, oid, {k: failure(e) for k, e in out.errors.items()})
        return oid, done

    async def retire(
        self, episode_ids: Iterable[EpisodeId], *, deadline_s: float | None = None
    ) -> RetireResult:
        episodes = [_episode(e) for e in episode_ids]
        if not episodes:
            raise InvalidRequest("retire needs at least one episode")
        async with self.lock:
            start = time.monotonic()
            oid, retired = await self._in_retire_order(
                "retire", "episode_ids", episodes, deadline_s
            )
            return RetireResult(operation_id=oid, seconds=time.monotonic() - start, retired=retired)

    async def forget(
        self, rollout_ids: Iterable[str], *, deadline_s: float | None = None
    ) -> ForgetResult:
        rollouts = list(rollout_ids)
        if not rollouts:
            raise InvalidRequest("forget needs at least one rollout id")
        async with self.lock:
            start = time.monotonic()
            oid, gone = await self._in_retire_order("forget", "rollout_ids", rollouts, deadline_s)
            return ForgetResult(operation_id=oid, seconds=time.monotonic() - start, forgotten=gone)

    # --- status / recovery -------------------------------------------------------
    async def status(self) -> CoordinatorStatus:
        hosts = sorted(self.hosts.values(), key=lambda h: h.member)
        tasks = [asyncio.ensure_future(h.status()) for h in hosts]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.timeouts.status_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending)
        rows = [_status_row(h, t) for h, t in zip(hosts, tasks, strict=True)]
        entry = self.open
        return CoordinatorStatus(
            open_checkpoint=entry.checkpoint_id if entry else None,
            phase=entry.phase if entry else None,
            pause_mode=self.pause_mode,
            controllers=sorted(self.pausers),
            participants=rows,
        )

    async def recover(self) -> str | None:
        """Abort what a previous coordinator left open (from the journal); idempotent."""
        async with self.lock:
            entry = self.journal.load()
            if entry is None:
                return None
            self.open = entry
            log.warning(
                "recovering %s left %s by a previous coordinator", entry.checkpoint_id, entry.phase
            )
            if entry.op == "restore" and entry.phase == "restoring":
                episodes = [EpisodeId.from_capture_key(k) for k in entry.episode_ids]
                await self._undo_restore(entry.checkpoint_id, episodes, self.clock.now())
            else:
                await self.resume_everyone(entry.checkpoint_id)
            return entry.checkpoint_id

    def members(self) -> list[Member]:
        return sorted(self._members())


def _status_row(host: Host, task: asyncio.Future[dict[str, Any]]) -> ParticipantStatus:
    m = host.member
    transport = host.describe().get("transport", "?")
    if task.cancelled():
        return ParticipantStatus(
            participant=m.key, kind=m.kind, transport=transport, error="no reply"
        )
    exc = task.exception()
    if exc is not None:
        return ParticipantStatus(
            participant=m.key, kind=m.kind, transport=transport, error=str(exc)[:200]
        )
    s = task.result()
    report = s.get("report") or {}
    return ParticipantStatus(
        participant=m.key,
        kind=m.kind,
        transport=transport,
        phase=s.get("phase"),
        checkpoint_id=s.get("checkpoint_id"),
        lease_expires_at=s.get("lease_expires_at"),
        live_executions=s.get("live_executions"),
        retired_rollouts=s.get("retired_rollouts"),
        blockers=[str(b.get("key")) for b in report.get("blockers", [])],
        blocker_count=int(report.get("blocker_count", 0)),
    )
