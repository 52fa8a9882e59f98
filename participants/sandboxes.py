"""Sandboxes as episode state: the participant layer that owns each episode's sandbox.

An environment (or resources) server whose episodes work in a tool sandbox
(`ray_ckpt.sandbox`) keeps the sandbox with the episode: it is captured with
the episode's record at the checkpoint's boundary, restored with it, and
freed when the attempt is retired.  `EpisodeSandboxes` is the part any kind
can hold (the handles, the open checkpoint's decisions, capture, restore,
free); `SandboxedEnvironment` is the environment participant built on it,
`SandboxedResources` the resources participant (exported sessions, each
session's sandbox in its record; a session is at its boundary when no counted
request of it is in flight).

What a checkpoint does with a sandboxed episode:

- **prepare** reports as a restart (`PrepareReport.restarts`) every episode
  whose sandbox cannot continue: `capability.continues(live_process=...)`
  is false (a process still running at the boundary while the provider
  copies only files, or a provider that captures nothing).  The decision is
  made once per episode per open checkpoint, when the episode is at a
  boundary, and remembered until admission reopens, so the export agrees
  with what the prepare reported even if the process ends in between;
- **export** leaves those out (a scope naming one: `RestartInScope`) and
  captures every other exported episode's sandbox: the record's state gains
  `"sandbox"` (the snapshot, plain JSON) and its `attachments` name the
  content-addressed files, which storage writes once per digest;
- **install** validates every record first, then restores every sandbox of
  every record in one provider call (all or nothing), then installs the
  episodes; if anything fails, the sandboxes just made are freed and the
  error raised: nothing is activated.  The restored sandboxes are the next
  generation, found by the continuing attempt (attempt + 1); the generation
  each replaced is fenced (its commands are refused) and freed when a
  retire covers its attempt;
- **retire** stops the episodes' tasks, then stops the sandboxes' processes
  and removes their files, all before it replies.

Steps that touch a sandbox must be `wait` steps (`ep.step("wait")`): a
checkpoint waits for them, so it never captures a sandbox mid-step.  A
`replay` step is exported as the boundary before it and may run on while
the checkpoint captures; after a restore it runs again from that boundary
against files it had already changed, which is not the state the boundary
names.  A capture that finds a process the prepare did not see (one a step
started after the decision) fails the commit instead of exporting a lie.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from participants.environment import EnvironmentParticipant
from participants.resources import ResourcesMode, ResourcesParticipant, SessionHooks, stage_sessions
from ray_ckpt.errors import (
    InvalidCheckpointState,
    InvalidPhase,
    InvalidRequest,
    RestartInScope,
)
from ray_ckpt.identity import EpisodeId, is_result_key
from ray_ckpt.reports import PrepareReport
from ray_ckpt.sandbox.provider import SandboxHandle, SandboxProvider, SandboxSnapshot
from ray_ckpt.steps import EpisodeSteps
from ray_ckpt.steps.modes import BLOCKING
from ray_ckpt.steps.persist import stage_records
from ray_ckpt.steps.receipts import ResultReceipts
from ray_ckpt.steps.retire_marks import retire_scope
from ray_ckpt.storage.records.record import Record

log = logging.getLogger(__name__)

# The key of a record's state that holds its sandbox's snapshot.
SANDBOX_KEY = "sandbox"

# Why an episode cannot continue, as `restart_reasons` says it.
LIVE_PROCESS = "live-process"
NOT_CAPTURED = "not-captured"

Staged = tuple[EpisodeId, SandboxSnapshot, Mapping[str, str]]


class EpisodeSandboxes:
    """Each episode attempt's sandbox and what a checkpoint does with it.

    Keyed by the attempt that works in it: a restored sandbox by the
    continuing attempt (attempt + 1).  Not thread-safe: one loop."""

    def __init__(self, provider: SandboxProvider) -> None:
        self.provider = provider
        self._handles: dict[EpisodeId, SandboxHandle] = {}
        # Generations a restore replaced, by the attempt that worked in them:
        # fenced at the restore, freed when a retire covers that attempt.
        self._replaced: dict[EpisodeId, SandboxHandle] = {}
        # The open checkpoint's decisions (episode -> why it restarts, or
        # None: it continues); None itself while admission is open.
        self._decided: dict[EpisodeId, str | None] | None = None
        self.copied_bytes = 0  # what captures copied (changed files only)
        self.captures = 0

    # --- the episode's side ---------------------------------------------------

    async def create(
        self, episode: EpisodeId, *, cwd: str = ".", env: Mapping[str, str] | None = None
    ) -> SandboxHandle:
        """A new sandbox for `episode` (refused if it has one)."""
        if episode in self._handles:
            raise InvalidRequest(f"episode {episode} has a sandbox already")
        handle = await self.provider.create(episode.capture_key, cwd=cwd, env=env)
        self._handles[episode] = handle
        return handle

    def handle(self, episode: EpisodeId) -> SandboxHandle | None:
        """The sandbox `episode` works in (a restored one under attempt + 1)."""
        return self._handles.get(episode)

    def held(self) -> list[EpisodeId]:
        return sorted(self._handles)

    # --- the open checkpoint's decisions --------------------------------------

    def window_closed(self) -> None:
        """A checkpoint closed admission: decide afresh, and remember."""
        if self._decided is None:
            self._decided = {}

    def window_opened(self) -> None:
        self._decided = None

    def restarts(self, settled: Iterable[EpisodeId]) -> dict[str, str]:
        """Capture key -> why, for every sandboxed episode that cannot continue.

        `settled`: the episodes at a boundary now (nothing of theirs runs until
        admission reopens but their sandbox's own background processes).  An
        episode mid-step is decided once it settles: its foreground command
        is a live process only until the step ends.  While a checkpoint is
        open each decision is kept, so the export agrees with the report."""
        at_boundary = set(settled)
        capability = self.provider.capability
        out: dict[str, str] = {}
        for eid, handle in self._handles.items():
            decided = self._decided
            if decided is not None and eid in decided:
                why = decided[eid]
            elif not capability.continues(live_process=False):
                why = NOT_CAPTURED  # whatever runs in it: nothing is captured
            elif eid in at_boundary:
                live = self.provider.alive(handle)
                why = None if capability.continues(live_process=live) else LIVE_PROCESS
            else:
                continue  # a blocker; decided when it reaches its boundary
            if decided is not None:
                decided[eid] = why
            if why is not None:
                out[eid.capture_key] = why
        return out

    # --- export ------------------------------------------------------------------

    async def capture(self, records: Sequence[Record]) -> list[Record]:
        """Each record with a sandbox, with its snapshot and files attached."""
        out: list[Record] = []
        for record in records:
            handle = None if is_result_key(record.key) else self._handles.get(record.episode_id)
            if handle is None:
                out.append(record)
                continue
            eid = record.episode_id
            if self._decided is not None and self._decided.get(eid) is not None:
                raise RestartInScope(f"episode {eid} restarts; its sandbox cannot be continued")
            captured = await self.provider.capture(handle)
            if captured.live and not self.provider.capability.continues(live_process=True):
                raise InvalidPhase(
                    f"episode {eid}: its sandbox ran a process at the capture that the "
                    "prepare did not see (a step touched the sandbox outside a wait step)"
                )
            self.copied_bytes += captured.copied_bytes
            self.captures += 1
            state = record.state
            if not isinstance(state, dict):
                raise InvalidPhase(f"episode {eid}: a record state that is not an object")
            state = {**state, SANDBOX_KEY: msgspec.to_builtins(captured.snapshot)}
            out.append(Record(record.key, state, None, dict(captured.attachments)))
        return out

    # --- install -----------------------------------------------------------------

    def stage(self, records: Sequence[Record]) -> tuple[list[Record], list[Staged]]:
        """Validate every record's sandbox (nothing changes): the records without
        it, and (attempt + 1, snapshot, files) per sandbox to restore."""
        plain: list[Record] = []
        staged: list[Staged] = []
        for record in records:
            state = record.state
            if is_result_key(record.key) or not isinstance(state, dict) or SANDBOX_KEY not in state:
                plain.append(record)
                continue
            eid = _episode_of(record)
            snapshot = self._snapshot(eid, state[SANDBOX_KEY])
            files = record.attachments or {}
            missing = sorted(snapshot.digests() - set(files))
            if missing:
                raise InvalidCheckpointState(
                    f"episode {eid}: its sandbox names {len(missing)} files the checkpoint "
                    f"does not hold (first {missing[0]})"
                )
            staged.append((eid.next(), snapshot, files))
            rest = {k: v for k, v in state.items() if k != SANDBOX_KEY}
            plain.append(Record(record.key, rest, record.version))
        return plain, staged

    def _snapshot(self, eid: EpisodeId, raw: Any) -> SandboxSnapshot:
        try:
            snapshot = msgspec.convert(raw, SandboxSnapshot)
        except msgspec.ValidationError as exc:
            raise InvalidCheckpointState(
                f"episode {eid}: malformed sandbox snapshot: {exc}"
            ) from None
        if snapshot.provider != self.provider.name:
            raise InvalidCheckpointState(
                f"episode {eid}: a sandbox of provider {snapshot.provider!r}; this server's "
                f"is {self.provider.name!r}"
            )
        return snapshot

    async def restore(self, staged: Sequence[Staged]) -> None:
        """Every staged sandbox as the next generation, in one provider call
        (all or nothing), held by its continuing attempt."""
        if not staged:
            return
        taken = sorted(str(eid) for eid, _, _ in staged if eid in self._handles)
        if taken:
            raise InvalidPhase(f"episodes {taken} hold a sandbox here already")
        handles = await self.provider.restore([(snap, files) for _, snap, files in staged])
        # No await from here on: held at once, so a failure (or a cancel)
        # later frees them through `drop` / `free_unheld`.
        for (eid, snap, _), handle in zip(staged, handles, strict=True):
            self._handles[eid] = handle
            self._replaced[_previous(eid)] = SandboxHandle(
                sandbox_id=snap.sandbox_id, generation=snap.generation
            )

    async def fence_replaced(self) -> None:
        """Refuse every command through a generation a restore replaced.  Best
        effort for one the provider never knew (made by a process now gone):
        the restore stands either way, and its files are freed on retire."""
        for handle in list(self._replaced.values()):
            try:
                await self.provider.fence(handle)
            except Exception:
                log.warning(
                    "sandbox %s: fencing a replaced generation failed", handle, exc_info=True
                )

    # --- free --------------------------------------------------------------------

    async def drop(self, episodes: Iterable[EpisodeId]) -> list[str]:
        """Free these attempts' sandboxes (and forget the generations they
        replaced, never freed by this): their capture keys."""
        freed: list[str] = []
        for eid in list(episodes):
            handle = self._handles.pop(eid, None)
            if eid.attempt > 0:
                self._replaced.pop(_previous(eid), None)
            if handle is not None:
                await self.provider.free(handle)
                freed.append(eid.capture_key)
        return freed

    async def free_unheld(self, holds: Callable[[EpisodeId], bool]) -> list[str]:
        """Free every sandbox whose attempt `holds` says nobody works in any more."""
        return await self.drop([eid for eid in self._handles if not holds(eid)])

    async def retire(self, episode_ids: Sequence[EpisodeId]) -> list[str]:
        """Free the sandboxes, and the replaced generations, of every attempt
        <= the given one of each rollout; their capture keys."""
        covered = retire_scope(episode_ids)
        keys = await self.drop([eid for eid in self._handles if covered(eid)])
        for eid in [eid for eid in self._replaced if covered(eid)]:
            await self.provider.free(self._replaced.pop(eid))
            keys.append(eid.capture_key)
        return sorted(set(keys))


def _refuse_restarts_in(scope: Sequence[EpisodeId] | None, restarts: Mapping[str, str]) -> None:
    """A commit scope may not name an episode whose sandbox cannot continue."""
    if scope is None:
        return
    named = sorted(e.capture_key for e in scope if e.capture_key in restarts)
    if named:
        raise RestartInScope(
            f"commit scope names episodes whose sandbox cannot continue {named} "
            f"({', '.join(sorted(set(restarts[k] for k in named)))})"
        )


def _with_restarts(report: PrepareReport, restarts: Mapping[str, str]) -> PrepareReport:
    if not restarts:
        return report
    return msgspec.structs.replace(report, restarts=sorted(set(report.restarts) | set(restarts)))


def _previous(eid: EpisodeId) -> EpisodeId:
    """The attempt a restored one (attempt >= 1) continues."""
    return EpisodeId(eid.rollout_id, eid.attempt - 1)


def _episode_of(record: Record) -> EpisodeId:
    try:
        return record.episode_id
    except InvalidRequest as exc:
        raise InvalidCheckpointState(f"record key: {exc.detail}") from None


class SandboxedEnvironment(EnvironmentParticipant):
    """The environment participant whose episodes each work in a sandbox.

    The server creates an episode's sandbox through `sandboxes.create`, finds
    a restored one by `sandboxes.handle(attempt)`, and calls `release` when the
    episode has ended; every checkpoint hook is the environment's, with the
    sandboxes captured, restored and freed along (module docstring)."""

    def __init__(
        self,
        steps: EpisodeSteps,
        provider: SandboxProvider,
        receipts: ResultReceipts | None = None,
    ) -> None:
        super().__init__(steps, receipts)
        self.sandboxes = EpisodeSandboxes(provider)

    # --- the open checkpoint ------------------------------------------------------

    def close_admission(self) -> None:
        self.sandboxes.window_closed()
        super().close_admission()

    def open_admission(self) -> None:
        super().open_admission()
        self.sandboxes.window_opened()

    def _settled(self) -> list[EpisodeId]:
        live = [ep.id for ep in self.steps.episodes() if ep.state not in BLOCKING]
        return live + self.steps.restored_ids()

    def restart_reasons(self) -> dict[str, str]:
        """Capture key -> why, for the sandboxed episodes that cannot continue now."""
        return self.sandboxes.restarts(self._settled())

    def report(self, limit: int) -> PrepareReport:
        return _with_restarts(super().report(limit), self.restart_reasons())

    async def export(self, scope: Sequence[EpisodeId] | None) -> list[Record]:
        restarts = self.restart_reasons()
        _refuse_restarts_in(scope, restarts)
        records = await super().export(scope)
        if scope is None:
            records = [r for r in records if r.key not in restarts]
        return await self.sandboxes.capture(records)

    # --- restore ---------------------------------------------------------------

    async def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        plain, staged = self.sandboxes.stage(records)
        # The episodes' own records are checked before any sandbox is made.
        stage_records([r for r in plain if not is_result_key(r.key)], set())
        await self.sandboxes.restore(staged)
        try:
            installed = await super().install(plain)
        except BaseException:
            await _shielded(self.sandboxes.drop(eid for eid, _, _ in staged))
            raise
        await self.sandboxes.fence_replaced()
        return installed

    async def delete_restored(self, keep: Sequence[EpisodeId]) -> list[str]:
        freed = await super().delete_restored(keep)
        dropped = await self.sandboxes.free_unheld(self.holds)
        return sorted(set(freed) | set(dropped))

    def holds(self, episode: EpisodeId) -> bool:
        """Does an attempt still work in (or wait to continue from) this episode's sandbox?"""
        return any(ep.id == episode for ep in self.steps.episodes()) or (
            episode in self.steps.restored_ids()
        )

    # --- retire and the end of an episode ----------------------------------------

    async def retire(self, episode_ids: Sequence[EpisodeId]) -> list[str]:
        keys = await super().retire(episode_ids)
        # After the episodes' tasks stopped: no step runs in them any more.
        freed = await self.sandboxes.retire(episode_ids)
        return sorted(set(keys) | set(freed))

    async def release(self, episode: EpisodeId) -> None:
        """The episode ended: free its sandbox, unless its restored entry
        still waits for a continuation (a replacement failed before moving on)."""
        if not self.holds(episode):
            await self.sandboxes.drop([episode])

    async def park_exported(self, records: list[Record]) -> None:
        """A durable commit that stops the server: the exported episodes'
        sandboxes are in the checkpoint, so their processes and files go."""
        await self.sandboxes.drop(
            r.episode_id for r in records if not is_result_key(r.key) and isinstance(r.state, dict)
        )


class SandboxedResources(ResourcesParticipant):
    """The resources participant (exported mode) whose sessions each own a sandbox.

    The server creates a session's sandbox through `sandboxes.create(session)`
    and finds a restored one by `sandboxes.handle(attempt)`, like an
    environment's episode; the session's own state leaves and returns through
    its `SessionHooks`, the sandbox along with it in the same record.  A
    session is at its boundary when no counted request of it is in flight, so
    every sandbox command must run inside a counted request (`enter` ...
    `leave`): a checkpoint then never captures it mid-command, and requests
    arriving meanwhile wait for the resume.  An uncounted (replayable) request
    must not touch the sandbox."""

    def __init__(self, hooks: SessionHooks, provider: SandboxProvider) -> None:
        # Only an exported session has a record to carry its sandbox in.
        super().__init__(hooks, mode=ResourcesMode.EXPORTED)
        self.sandboxes = EpisodeSandboxes(provider)

    # --- the open checkpoint ------------------------------------------------------

    def close_admission(self) -> None:
        self.sandboxes.window_closed()
        super().close_admission()

    def open_admission(self) -> None:
        super().open_admission()
        self.sandboxes.window_opened()

    def restart_reasons(self) -> dict[str, str]:
        """Capture key -> why, for the sandboxed sessions that cannot continue now."""
        busy = self.busy()
        return self.sandboxes.restarts(e for e in self.sandboxes.held() if e not in busy)

    def report(self, limit: int) -> PrepareReport:
        return _with_restarts(super().report(limit), self.restart_reasons())

    async def export(self, scope: Sequence[EpisodeId] | None) -> list[Record]:
        restarts = self.restart_reasons()
        _refuse_restarts_in(scope, restarts)
        if scope is None:
            # The hooks are never asked for a session that restarts.
            scope = sorted(e for e in self.sessions if e.capture_key not in restarts)
        return await self.sandboxes.capture(await super().export(scope))

    # --- restore ---------------------------------------------------------------

    async def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        plain, staged = self.sandboxes.stage(records)
        # The sessions' own records are checked before any sandbox is made.
        stage_sessions(plain)
        await self.sandboxes.restore(staged)
        try:
            installed = await super().install(plain)
        except BaseException:
            await _shielded(self.sandboxes.drop(eid for eid, _, _ in staged))
            raise
        await self.sandboxes.fence_replaced()
        return installed

    async def delete_restored(self, keep: Sequence[EpisodeId]) -> list[str]:
        kept = set(keep)
        unkept = [e for e in self.restored if e not in kept]
        freed = await super().delete_restored(keep)
        dropped = await self.sandboxes.drop(unkept)
        return sorted(set(freed) | set(dropped))

    # --- retire and the end of a session -----------------------------------------

    async def retire(self, episode_ids: Sequence[EpisodeId]) -> list[str]:
        keys = await super().retire(episode_ids)
        # After the session's requests stopped: no command runs in it any more.
        freed = await self.sandboxes.retire(episode_ids)
        return sorted(set(keys) | set(freed))

    async def end_session(self, episode: EpisodeId) -> bool:
        known = await super().end_session(episode)
        await self.sandboxes.drop([episode])
        return known

    async def park_exported(self, records: list[Record]) -> None:
        """A durable commit that stops the server: the exported sessions'
        sandboxes are in the checkpoint, so their processes and files go."""
        await self.sandboxes.drop(r.episode_id for r in records if not is_result_key(r.key))


async def _shielded(work: Coroutine[Any, Any, Any]) -> None:
    """Run cleanup to its end even if the caller is cancelled meanwhile."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise
