"""Typed results of coordinated operations (what the handle and CLI return)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from ray_ckpt.identity import is_result_key
from ray_ckpt.storage.root.history import RestartBias


class Timeouts(msgspec.Struct, frozen=True, kw_only=True):
    """Phase deadlines (seconds from the start of the call) and the renew cadence."""

    prepare_s: float = 60.0
    commit_s: float = 300.0
    resume_s: float = 30.0
    restore_s: float = 300.0
    retire_s: float = 120.0
    status_s: float = 10.0
    pause_s: float = 30.0
    # Renew every lease this often while a checkpoint stays open (publishing).
    renew_every_s: float = 60.0
    # Added to a call's remaining time so the participant's own reply at its
    # deadline (e.g. prepare's blockers) wins the race against our timeout.
    reply_grace_s: float = 2.0
    # A failed restore's cleanup gets at least this long.
    cleanup_min_s: float = 30.0


class PrepareResult(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: str
    seconds: float
    timings: dict[str, float]  # participant → prepare seconds
    restarts: dict[str, list[str]]  # participant → restart-only episodes (never exported)


class CommitResult(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: str
    checkpoint_dir: str
    seconds: float
    manifest_s: float
    timings: dict[str, float]
    # participant → bytes of its records object; None while `pending`: not
    # written yet, so unknown (never 0): `DurableResult.bytes` gives them.
    bytes: Mapping[str, int | None]
    episode_ids: dict[str, list[str]]  # participant → capture keys exported
    # Per episode of the scope (capture keys): some participant exported state
    # for it (`continued`), or none did and it starts over (`restart`).
    continued: list[str] = msgspec.field(default_factory=list)
    restart: list[str] = msgspec.field(default_factory=list)
    # An asynchronous commit: records captured, still being written; no Gym
    # manifest yet (`coordination.engine.coordinator_core`).
    pending: bool = False

    @property
    def total_bytes(self) -> int | None:
        """Every participant's bytes, summed; None if any is unknown (pending)."""
        known = [n for n in self.bytes.values() if n is not None]
        return sum(known) if len(known) == len(self.bytes) else None


class ResumeResult(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: str | None
    seconds: float
    # Participants that could not be reached resume when their lease lapses.
    failures: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)


class CheckpointResult(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: str
    checkpoint_dir: str
    total_s: float
    prepare_s: float
    commit_s: float
    manifest_s: float
    resume_s: float | None  # None when the checkpoint was left open for publishing
    timings: dict[str, dict[str, float]]  # participant → {op: seconds}
    # As in `CommitResult`: None per participant while `pending` (nothing is
    # written yet, and the capture is measured by the write, after the
    # resume), and `total_bytes` None then too; `PendingCheckpoint.durable()`
    # gives both figures (`DurableResult.bytes`, `.captured_bytes`).
    bytes: Mapping[str, int | None]
    total_bytes: int | None
    episode_ids: dict[str, list[str]]
    restarts: dict[str, list[str]]
    resume_failures: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    continued: list[str] = msgspec.field(default_factory=list)  # as in `CommitResult`
    restart: list[str] = msgspec.field(default_factory=list)
    # "async": returned once the Gym resumed, before durability (`pending`);
    # `PendingCheckpoint.durable()` resolves when the Gym manifest is written.
    durability: str = "sync"
    pending: bool = False

    @property
    def episodes(self) -> int:
        """Its episodes as `inspect`, `list` and the demo count them: distinct
        capture keys any participant wrote, held results (`result:`) left out."""
        return len({k for keys in self.episode_ids.values() for k in keys if not is_result_key(k)})


class DurableResult(msgspec.Struct, frozen=True, kw_only=True):
    """An asynchronous checkpoint once every participant is durable and its
    Gym manifest (and `LATEST`) written, last."""

    checkpoint_id: str
    checkpoint_dir: str
    durable_s: float  # from the resume to the Gym manifest written
    manifest_s: float
    bytes: dict[str, int]  # participant → bytes of its records object
    total_bytes: int
    # The captured copies' own memory, summed (measured by each write, after
    # the resume: `ray_ckpt.control.capture`).
    captured_bytes: int = 0


class RestoreResult(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: str
    source_checkpoint_id: str | None
    checkpoint_dir: str
    total_s: float
    timings: dict[str, float]
    restored: dict[str, list[str]]  # participant → next-attempt capture keys
    resumed: bool
    # Per requested episode (its capture key as requested): some participant
    # installed its next attempt (`continued`), or none held state for it and
    # that next attempt starts over (`restart`).
    continued: list[str] = msgspec.field(default_factory=list)
    restart: list[str] = msgspec.field(default_factory=list)
    # Participants the resume after the restore did not reach (their lease
    # lapses and they resume by themselves, keeping what they installed).
    resume_failures: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    # How many episodes continued, restarted or were lost, by how far each
    # had got (`ray_ckpt.storage.root.history.RestartBias`).
    restart_bias: RestartBias | None = None


class RetireResult(msgspec.Struct, frozen=True, kw_only=True):
    operation_id: str
    seconds: float
    retired: dict[str, list[str]]


class ForgetResult(msgspec.Struct, frozen=True, kw_only=True):
    operation_id: str
    seconds: float
    forgotten: dict[str, list[str]]


class ParticipantStatus(msgspec.Struct, frozen=True, kw_only=True):
    participant: str
    kind: str
    transport: str
    phase: str | None = None
    checkpoint_id: str | None = None
    lease_expires_at: float | None = None
    live_executions: int | None = None
    retired_rollouts: int | None = None
    blockers: list[str] = msgspec.field(default_factory=list)
    blocker_count: int = 0
    # Per blocker what the participant says beyond its key (state, step, ...):
    # from `report.blocker_details`, or object-shaped `blockers` of older
    # participants; just `{"key"}` for a participant that sends strings only.
    blocker_details: list[dict[str, Any]] = msgspec.field(default_factory=list)
    # Commit writes under way (None: a participant that does not say).
    writes_in_flight: int | None = None
    error: str | None = None
    # Completion receipts: finished results held until acknowledged (None:
    # a participant that does not say).
    unacknowledged_results: int | None = None
    unacknowledged_bytes: int | None = None
    # The capture keys in flight (capped; None: a participant that does not
    # say), and whether its export needs a named scope.
    live_keys: list[str] | None = None
    needs_scope: bool = False


class PeriodicStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The periodic checkpoint loop (`coordination.triggers.periodic`): its settings,
    counts, and the last checkpoint and error."""

    root: str
    every_s: float
    keep_latest_k: int | None
    running: bool
    started_at: float
    next_at: float | None = None
    attempts: int = 0
    completed: int = 0
    failed: int = 0
    consecutive_failures: int = 0
    last_name: str | None = None
    last_checkpoint_id: str | None = None
    last_completed_at: float | None = None
    # {"code", "detail", "name", "at"} of the last failed checkpoint.
    last_error: dict[str, Any] | None = None
    deleted: int = 0  # checkpoints retention removed
    last_retention_error: dict[str, Any] | None = None


class LastCheckpoint(msgspec.Struct, frozen=True, kw_only=True):
    """The newest checkpoint this coordinator completed (`checkpoint()`)."""

    checkpoint_id: str
    checkpoint_dir: str
    finished_at: float  # epoch seconds
    total_s: float
    bytes: int | None  # None for an asynchronous one (not written when it returned)
    trigger: str
    episodes: int | None = None  # `CheckpointResult.episodes`


class CoordinatorStatus(msgspec.Struct, frozen=True, kw_only=True):
    open_checkpoint: str | None
    phase: str | None
    pause_mode: str
    controllers: list[str]
    participants: list[ParticipantStatus]
    periodic: PeriodicStatus | None = None
    last_checkpoint: LastCheckpoint | None = None
    now: float | None = None  # the coordinator's clock when it answered (ages, leases)
    # An assembler's scope method is registered: a checkpoint without a scope
    # continues its in-flight episodes.
    scope_source: bool = False
    # This coordinator's epoch (`coordination.engine.epoch`; None: not fenced).
    epoch: int | None = None
