"""The checkpoint phases, without Ray: order, deadlines, abort, journal.

`PhaseDriver` (the base of `CoordinatorCore`) drives registered hosts
(`coordination.hosts`) through the ordered phases.  The `Coordinator` actor
only adds Ray around it (discovery by name, recovery on restart), so
everything here is unit-tested with fake hosts.

One coordinated operation runs at a time (a lock); the split
`prepare`/`commit`/`resume` calls keep the open checkpoint between calls.
Every failure path resumes whatever a checkpoint touched — participants in
reverse order, continuing past failures, then the paused controller actors —
and raises `CoordinationFailed` naming each participant and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from coordination.fanout import Outcome, failure, fan_out
from coordination.hosts import Host, PauseTarget
from coordination.journal import Journal, JournalEntry
from coordination.order import Member, commit_groups, prepare_groups, resume_groups
from coordination.results import (
    CommitResult,
    PrepareResult,
    ResumeResult,
    Timeouts,
)
from ray_ckpt.clock import SYSTEM_CLOCK, Clock
from ray_ckpt.errors import (
    CheckpointConflict,
    CheckpointError,
    CoordinationFailed,
    DeadlineExceeded,
    InvalidRequest,
)
from ray_ckpt.identity import EpisodeId

log = logging.getLogger(__name__)

PAUSE_MODES = ("full", "barrier")
ManifestWriter = Callable[[str, str, list[dict[str, Any]]], Any]


def write_gym_manifest_from_replies(
    checkpoint_dir: str, checkpoint_id: str, manifests: list[dict[str, Any]]
) -> Any:
    """The real writer: participant manifests from commit replies → Gym manifest."""
    import msgspec

    from ray_ckpt.storage import ParticipantManifest, write_gym_manifest

    parsed = [msgspec.convert(m, ParticipantManifest) for m in manifests]
    return write_gym_manifest(checkpoint_dir, checkpoint_id=checkpoint_id, manifests=parsed)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


# How often the renewer looks at the clock (it calls participants only when due).
_RENEW_POLL_S = 0.2

class PhaseDriver:
    def __init__(
        self,
        *,
        clock: Clock = SYSTEM_CLOCK,
        journal: Journal | None = None,
        timeouts: Timeouts | None = None,
        manifest_writer: ManifestWriter = write_gym_manifest_from_replies,
        pause_mode: str = "full",
    ) -> None:
        self.clock = clock
        self.journal = journal or Journal(None)
        self.timeouts = timeouts or Timeouts()
        self.manifest_writer = manifest_writer
        self.hosts: dict[str, Host] = {}
        self.pausers: dict[str, PauseTarget] = {}
        self.pause_mode = pause_mode
        self.open: JournalEntry | None = None
        self.lock = asyncio.Lock()
        self._renewer: asyncio.Task[None] | None = None
        # The latest deadline sent in the open checkpoint: every participant's
        # lease runs at least to it plus its grace, whatever that grace is.
        self._lease_floor = 0.0
        self._paused: list[str] = []  # roles paused for the open checkpoint

    # --- membership ----------------------------------------------------------
    def register(self, host: Host) -> None:
        self.hosts[host.member.key] = host

    def unregister(self, key: str) -> None:
        self.hosts.pop(key, None)

    def register_pause(self, target: PauseTarget, *, mode: str | None = None) -> None:
        if target.role not in ("trainer", "assembler"):
            raise InvalidRequest(f"pause role must be trainer or assembler, not {target.role!r}")
        if mode is not None:
            if mode not in PAUSE_MODES:
                raise InvalidRequest(f"pause mode must be one of {PAUSE_MODES}")
            self.pause_mode = mode
        self.pausers[target.role] = target

    def _hosts(self, group: Sequence[Member]) -> list[Host]:
        return [self.hosts[m.key] for m in group]

    def _members(self) -> list[Member]:
        return [h.member for h in self.hosts.values()]

    def _record(self, entry: JournalEntry | None) -> None:
        self.open = entry
        if entry is None:
            self.journal.clear()
            return
        entry.updated_at = self.clock.now()
        entry.members = {k: h.describe() for k, h in self.hosts.items()}
        self.journal.record(entry)

    def _timeout(self, deadline_ts: float) -> float:
        return max(deadline_ts - self.clock.now(), 0.0) + self.timeouts.reply_grace_s

    async def _group(
        self, group: Sequence[Member], op: str, body: Mapping[str, Any], deadline_ts: float
    ) -> Outcome:
        """One group's calls, together, under the deadline (plus the reply grace)."""
        if op in ("prepare", "commit"):
            self._lease_floor = max(self._lease_floor, deadline_ts)
        return await fan_out(self._hosts(group), op, lambda h: body, self._timeout(deadline_ts))

    # --- controller-side pause -------------------------------------------------
    def _prepare_roles(self) -> tuple[str, ...]:
        return ("assembler", "trainer") if self.pause_mode == "full" else ("assembler",)

    async def _pause(self, cid: str, roles: Sequence[str], deadline_s: float) -> None:
        for role in roles:
            target = self.pausers.get(role)
            if target is None:
                continue
            # Recorded before the call: a pause that half-happened is still undone.
            self._paused.append(role)
            try:
                await asyncio.wait_for(target.pause(cid, deadline_s), self.timeouts.pause_s)
            except TimeoutError:
                err: CheckpointError = DeadlineExceeded(f"{role} did not pause in time")
                raise CoordinationFailed(
                    f"pause of {role} failed", operation="pause", failures={role: failure(err)}
                ) from None
            except CheckpointError as exc:
                raise CoordinationFailed(
                    f"pause of {role} failed: {exc}",
                    operation="pause",
                    failures={role: failure(exc)},
                ) from None

    async def _unpause(self, cid: str, roles: Sequence[str] | None = None) -> dict[str, Any]:
        failures: dict[str, Any] = {}
        for role in reversed(list(self._paused)):
            if roles is not None and role not in roles:
                continue
            self._paused.remove(role)
            target = self.pausers.get(role)
            if target is None:
                continue
            try:
                await asyncio.wait_for(target.resume(cid), self.timeouts.pause_s)
            except (TimeoutError, CheckpointError) as exc:
                err = exc if isinstance(exc, CheckpointError) else DeadlineExceeded(str(exc))
                failures[role] = failure(err)
                log.warning("resume of %s for %s failed: %s", role, cid, exc)
        return failures

    # --- renewer -------------------------------------------------------------
    def _start_renewer(self, cid: str) -> None:
        self._stop_renewer()
        self._lease_floor = 0.0
        self._renewer = asyncio.ensure_future(self._renew_loop(cid))

    def _stop_renewer(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None

    async def _renew_loop(self, cid: str) -> None:
        """Renew every `renew_every_s`, and always before the latest deadline we
        sent passes: a lease is only sure to last that long plus its grace, and
        the grace (each participant's setting) is not known here."""
        poll_s = min(_RENEW_POLL_S, self.timeouts.renew_every_s)
        margin_s = max(0.1 * self.timeouts.resume_s, _RENEW_POLL_S)
        last = self.clock.now()
        while self.open is not None and self.open.checkpoint_id == cid:
            await asyncio.sleep(poll_s)
            if self.open is None or self.open.checkpoint_id != cid:
                return
            now = self.clock.now()
            floor_due = 0.0 < self._lease_floor <= now + margin_s
            if floor_due or now - last >= self.timeouts.renew_every_s:
                last = now
                with contextlib.suppress(CheckpointError):
                    await self._renew()

    async def _renew(self) -> dict[str, float | None]:
        """Extend every lease of the open checkpoint (publishing takes long)."""
        entry = self.open
        if entry is None:
            return {}
        deadline_ts = self.clock.now() + self.timeouts.resume_s
        self._lease_floor = max(self._lease_floor, deadline_ts)
        body = {"checkpoint_id": entry.checkpoint_id, "deadline_ts": deadline_ts}
        out = await fan_out(
            list(self.hosts.values()), "renew", lambda h: body, self._timeout(deadline_ts)
        )
        for key, err in out.errors.items():
            log.warning("renew of %s at %s failed: %s", entry.checkpoint_id, key, err)
        return {k: r.get("lease_expires_at") for k, r in out.replies.items()}

    # --- checkpoint: prepare ---------------------------------------------------
    async def _prepare(self, deadline_s: float | None = None) -> PrepareResult:
        if self.open is not None:
            raise CheckpointConflict(
                f"checkpoint {self.open.checkpoint_id} is open ({self.open.phase}); resume it first"
            )
        members = self._members()
        if not members:
            raise InvalidRequest("no participants are registered")
        start = time.monotonic()
        cid = new_id("ckpt")
        deadline_s = self.timeouts.prepare_s if deadline_s is None else deadline_s
        deadline_ts = self.clock.now() + deadline_s
        self._record(JournalEntry(checkpoint_id=cid, phase="preparing", op="checkpoint"))
        self._start_renewer(cid)
        try:
            await self._pause(cid, self._prepare_roles(), deadline_s)
        except CoordinationFailed as exc:
            await self._abort(cid)
            raise exc from None
        body = {"checkpoint_id": cid, "deadline_ts": deadline_ts}
        timings: dict[str, float] = {}
        restarts: dict[str, list[str]] = {}
        for group in prepare_groups(members):
            out = await self._group(group, "prepare", body, deadline_ts)
            timings.update(out.timings)
            failures = {k: failure(e) for k, e in out.errors.items()}
            for key, reply in out.replies.items():
                report = reply.get("report") or {}
                if report.get("restarts"):
                    restarts[key] = list(report["restarts"])
                if reply.get("phase") != "prepared":
                    err = DeadlineExceeded(
                        f"{key} is not prepared at the deadline (phase {reply.get('phase')})"
                    )
                    failures[key] = failure(err, report)
            if failures:
                await self._abort(cid)
                raise _failed("prepare", cid, failures)
        self._record(JournalEntry(checkpoint_id=cid, phase="prepared", op="checkpoint"))
        return PrepareResult(
            checkpoint_id=cid, seconds=time.monotonic() - start, timings=timings, restarts=restarts
        )

    # --- checkpoint: commit ----------------------------------------------------
    async def _commit(
        self,
        checkpoint_dir: str,
        scope: Sequence[EpisodeId] | None = None,
        *,
        stop: bool = False,
        deadline_s: float | None = None,
    ) -> CommitResult:
        entry = self.open
        if (
            entry is None
            or entry.op != "checkpoint"
            or entry.phase not in ("prepared", "committing")
        ):
            raise CheckpointConflict("no prepared checkpoint is open: prepare first")
        cid = entry.checkpoint_id
        start = time.monotonic()
        deadline_s = self.timeouts.commit_s if deadline_s is None else deadline_s
        deadline_ts = self.clock.now() + deadline_s
        self._record(
            JournalEntry(
                checkpoint_id=cid,
                phase="committing",
                op="checkpoint",
                checkpoint_dir=checkpoint_dir,
            )
        )
        body: dict[str, Any] = {
            "checkpoint_id": cid,
            "deadline_ts": deadline_ts,
            "checkpoint_dir": checkpoint_dir,
            "episode_ids": None if scope is None else [_episode(e) for e in scope],
            "stop": stop,
        }
        barrier = ("trainer",) if self.pause_mode == "barrier" else ()
        out = Outcome()
        try:
            await self._pause(cid, barrier, deadline_s)
            for group in commit_groups(self._members()):
                out.merge(await self._group(group, "commit", body, deadline_ts))
        except CoordinationFailed as exc:
            await self._abort(cid)
            raise exc from None
        finally:
            await self._unpause(cid, barrier)
        if out.errors:
            await self._abort(cid)
            raise _failed("commit", cid, {k: failure(e) for k, e in out.errors.items()})
        manifests = [r.get("manifest") or {} for _, r in sorted(out.replies.items())]
        m_start = time.monotonic()
        try:
            # Last of all: the Gym manifest is the commit point of the whole checkpoint.
            await asyncio.to_thread(self.manifest_writer, checkpoint_dir, cid, manifests)
        except Exception as exc:
            await self._abort(cid)
            err = exc if isinstance(exc, CheckpointError) else CheckpointError(repr(exc))
            raise _failed("commit", cid, {"gym-manifest": failure(err)}) from None
        manifest_s = time.monotonic() - m_start
        self._record(
            JournalEntry(
                checkpoint_id=cid, phase="committed", op="checkpoint", checkpoint_dir=checkpoint_dir
            )
        )
        return CommitResult(
            checkpoint_id=cid,
            checkpoint_dir=checkpoint_dir,
            seconds=time.monotonic() - start,
            manifest_s=manifest_s,
            timings=out.timings,
            bytes={
                k: int((r.get("manifest") or {}).get("bytes", 0)) for k, r in out.replies.items()
            },
            episode_ids={k: list(r.get("episode_ids", [])) for k, r in out.replies.items()},
        )

    # --- resume / abort --------------------------------------------------------
    async def _resume(self, deadline_s: float | None = None) -> ResumeResult:
        """Resume (or abort) the open checkpoint; never raises for participants."""
        entry = self.open
        start = time.monotonic()
        if entry is None:
            return ResumeResult(checkpoint_id=None, seconds=0.0)
        failures = await self.resume_everyone(entry.checkpoint_id, deadline_s)
        return ResumeResult(
            checkpoint_id=entry.checkpoint_id, seconds=time.monotonic() - start, failures=failures
        )

    async def resume_everyone(self, cid: str, deadline_s: float | None = None) -> dict[str, Any]:
        """Participants in reverse order (past failures), then paused controllers."""
        entry = self.open
        if entry is not None and entry.checkpoint_id == cid:
            entry.phase = "resuming"
            self._record(entry)
        deadline_s = self.timeouts.resume_s if deadline_s is None else deadline_s
        deadline_ts = self.clock.now() + deadline_s
        body = {"checkpoint_id": cid, "deadline_ts": deadline_ts}
        failures: dict[str, Any] = {}
        # Everyone, not only those that prepared: a participant the prepare
        # never reached still records the ID, so a delayed prepare is refused.
        for group in resume_groups(self._members()):
            out = await self._group(group, "resume", body, deadline_ts)
            failures.update({k: failure(e) for k, e in out.errors.items()})
        failures.update(await self._unpause(cid))
        self._stop_renewer()
        self._record(None)
        for key, why in failures.items():
            log.warning("resume of %s at %s failed (its lease will lapse): %s", cid, key, why)
        return failures

    async def _abort(self, cid: str) -> None:
        await self.resume_everyone(cid)

    async def aclose(self) -> None:
        self._stop_renewer()
        for host in list(self.hosts.values()):
            with contextlib.suppress(Exception):
                await host.aclose()


def _episode(e: EpisodeId | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(e, EpisodeId):
        return {"rollout_id": e.rollout_id, "attempt": e.attempt}
    return dict(e)


def _failed(op: str, cid: str, failures: dict[str, dict[str, Any]]) -> CoordinationFailed:
    names = ", ".join(
        f"{k} ({v['code']}" + (f"; blockers {v['blockers']}" if v.get("blockers") else "") + ")"
        for k, v in sorted(failures.items())
    )
    return CoordinationFailed(f"{op} of {cid} failed at {names}", operation=op, failures=failures)
