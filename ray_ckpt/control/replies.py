"""The control routes' replies, as msgspec types: what `ray-ckpt schema` publishes.

The engine builds its replies as plain dicts (`ray_ckpt.control.engine`);
these types describe them field by field so that the JSON Schema of every
reply is generated from a type (`ray_ckpt.control.schema`), as the requests'
is from `ray_ckpt.control.wire`.  The conformance suite validates every reply
it receives from our participants against them, so a field added to a reply
without being added here fails there, not in a user's client.

The replies' top-level objects forbid unknown fields (the published schema
says `additionalProperties: false`): the schema is the list of what a reply
carries today.  Nested objects shared with other code (`ReportReply`, the
participant manifest) keep their own rules.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ray_ckpt.reports import Receipt, ReportReply
from ray_ckpt.storage.participant.participant_manifest import ParticipantManifest

# `ray_ckpt.control.phase_machine.Phase`'s values (a test keeps them equal).
PhaseName = Literal["idle", "preparing", "prepared", "committed", "restored"]


class _Reply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


# --- status ------------------------------------------------------------------


class BackgroundWrite(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The asynchronous commit's write in flight."""

    checkpoint_id: str
    # Null until the write has read (and measured) the whole capture.
    captured_bytes: int | None


class StatusReply(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`GET status`: the participant's phase, lease, work and readiness."""

    kind: str
    instance: str
    phase: PhaseName
    checkpoint_id: str | None
    lease_expires_at: float | None
    retired_rollouts: int
    retiring: int
    live_executions: int
    fresh: bool
    writes_in_flight: int
    background_write: BackgroundWrite | None
    completion_receipts: bool
    unacknowledged_results: int
    unacknowledged_bytes: int
    report: ReportReply
    process: str
    # The newest coordinator epoch seen (null: none yet) and the calls refused
    # as fenced, by code; absent from a participant that predates epochs.
    coordinator_epoch: int | msgspec.UnsetType | None = msgspec.UNSET
    fenced: dict[str, int] | msgspec.UnsetType = msgspec.UNSET
    # Only with `?processes=1`: the pids accepting on the port the call came
    # in on, or null where the server cannot tell.
    accepting_processes: list[int] | msgspec.UnsetType | None = msgspec.UNSET
    # Only on a server whose workers the host manages (`ray_ckpt.workers`).
    workers: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET
    # The capture keys in flight (sorted, capped as blockers are; null: a
    # participant that cannot list them), and whether its export needs a
    # named scope (`ray-ckpt checkpoint` without one is refused up front).
    live_keys: list[str] | msgspec.UnsetType | None = msgspec.UNSET
    needs_scope: bool | msgspec.UnsetType = msgspec.UNSET


# --- checkpoint phases -----------------------------------------------------------


class PrepareReply(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`prepared` once every live execution is at a boundary; `preparing` with
    blockers when the deadline passed first; `idle` when a resume ended the
    checkpoint during the wait."""

    phase: Literal["idle", "preparing", "prepared"]
    report: ReportReply


class RenewReply(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    lease_expires_at: float | None


class Span(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One step of the commit on the participant's clock (epoch seconds)."""

    name: str  # capture, write, release
    start: float
    end: float


class Progress(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How far one exported episode had got, as far as its record says
    (the restart bias of a restore from this checkpoint is counted from it)."""

    steps: Annotated[int, msgspec.Meta(ge=0)] | msgspec.UnsetType = msgspec.UNSET
    tokens: Annotated[int, msgspec.Meta(ge=0)] | msgspec.UnsetType = msgspec.UNSET


# By capture key; absent when no exported record says.
ProgressMap = dict[str, Progress] | msgspec.UnsetType


class CommitReply(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A durable commit: synchronous, or an asynchronous one re-sent once written."""

    phase: Literal["committed"]
    manifest: ParticipantManifest
    episode_ids: list[str]  # capture keys
    # Finished results carried apart (completion receipts); absent when none.
    results: int | msgspec.UnsetType = msgspec.UNSET
    progress: ProgressMap = msgspec.UNSET
    spans: list[Span]
    # Only on an asynchronous commit's final reply: the capture's own size.
    captured_bytes: int | msgspec.UnsetType | None = msgspec.UNSET


class CommitPendingReply(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`durability: "async"`: captured, to be written after the resume."""

    phase: Literal["committed"]
    pending: Literal[True]
    captured_bytes: int | None
    episode_ids: list[str]
    results: int | msgspec.UnsetType = msgspec.UNSET
    progress: ProgressMap = msgspec.UNSET
    spans: list[Span]


class RestoreReply(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    phase: Literal["restored"]
    source_checkpoint_id: str | None
    restored: list[str]  # capture keys of the installed attempts (attempt + 1)


class ResumeReply(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    phase: PhaseName
    # True when nothing was open under this ID (resumed before, or never prepared).
    idempotent: bool


class RetireReply(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    retired: list[str]  # capture keys stopped or freed


class ForgetReply(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    forgotten: list[str]  # rollout IDs whose retire marks were dropped


# --- completion receipts -----------------------------------------------------------


class AckReply(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    acknowledged: list[Receipt]
    already: list[Receipt]
    completion_receipts: bool
    unacknowledged_results: int
    unacknowledged_bytes: int


class AckCheckReply(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`"check": true`: which receipts are known here; nothing changes."""

    known: list[Receipt]
    unknown: list[Receipt]


class Collected(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    receipt: Receipt
    result: dict[str, Any]


class CollectReply(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    results: list[Collected]
    completion_receipts: bool
    unacknowledged_results: int
    unacknowledged_bytes: int


# --- rejections ------------------------------------------------------------------


class ErrorDetail(msgspec.Struct, frozen=True, kw_only=True):
    """`code` is a `ray_ckpt.errors.Reason` value, or `internal` for a bug."""

    code: str
    detail: str


class ErrorReply(_Reply, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Every rejection, whatever the route: `{"error": {"code", "detail"}}`."""

    error: ErrorDetail
