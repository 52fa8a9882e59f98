"""Failure reasons as data: one root exception, one reason enum.

Every rejection a participant or the coordinator makes carries a `Reason`: a
stable string code (what goes on the wire), the HTTP status the control routes
answer with, and whether retrying the same call later can succeed.  The codes
and statuses match NeMo Gym's checkpoint control plane so that a controller
written for its participants can drive ours.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class Reason(StrEnum):
    """Why a control or data call was refused; the value is the wire code."""

    UNAUTHORIZED = "unauthorized"
    INVALID_REQUEST = "invalid_request"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    STALE_CHECKPOINT = "stale_checkpoint"
    CHECKPOINT_CONFLICT = "checkpoint_conflict"
    INVALID_PHASE = "invalid_phase"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    STALE_ATTEMPT = "stale_attempt"
    ADMISSION_CLOSED = "admission_closed"
    ROLLOUT_ID_REQUIRED = "rollout_id_required"
    RESTART_IN_SCOPE = "restart_in_scope"
    INVALID_CHECKPOINT_STATE = "invalid_checkpoint_state"
    PARTICIPANT_UNAVAILABLE = "participant_unavailable"
    COORDINATION_FAILED = "coordination_failed"
    # Completion receipts (`ray_ckpt.steps.receipts`).
    UNKNOWN_RECEIPT = "unknown_receipt"
    FINISHED_IN_SCOPE = "finished_in_scope"
    RECEIPTS_OFF = "receipts_off"
    RESULT_HELD = "result_held"
    MEMBERSHIP_CHANGED = "membership_changed"
    # A restore aimed at participants that already served (a live fleet).
    NOT_FRESH = "not_fresh"
    # A multi-worker participant lost a worker holding restored state
    # between the restore's install and its resume (`ray_ckpt.workers`).
    RESTORED_STATE_LOST = "restored_state_lost"
    # A control call from a coordinator older than the newest one the
    # participant has seen (its epoch, `coordination.engine.epoch`), or a
    # coordinator that found a newer one took over before it published.
    STALE_COORDINATOR = "stale_coordinator"
    # Sandboxes (`ray_ckpt.sandbox`): a command sent through a handle of a
    # generation a restore replaced (or a sandbox freed), and input a
    # sandbox refuses (a path escaping it, a device or socket file, a file
    # over the size bound).
    SANDBOX_FENCED = "sandbox_fenced"
    SANDBOX_REFUSED = "sandbox_refused"

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self]

    @property
    def retryable(self) -> bool:
        return self in _RETRYABLE


_HTTP_STATUS: dict[Reason, int] = {
    Reason.UNAUTHORIZED: 401,
    Reason.INVALID_REQUEST: 400,
    Reason.PAYLOAD_TOO_LARGE: 413,
    Reason.NOT_FOUND: 404,
    Reason.METHOD_NOT_ALLOWED: 405,
    Reason.STALE_CHECKPOINT: 409,
    Reason.CHECKPOINT_CONFLICT: 409,
    Reason.INVALID_PHASE: 409,
    Reason.DEADLINE_EXCEEDED: 409,
    Reason.STALE_ATTEMPT: 409,
    Reason.ADMISSION_CLOSED: 409,
    Reason.ROLLOUT_ID_REQUIRED: 400,
    Reason.RESTART_IN_SCOPE: 409,
    Reason.INVALID_CHECKPOINT_STATE: 422,
    Reason.PARTICIPANT_UNAVAILABLE: 503,
    Reason.COORDINATION_FAILED: 502,
    Reason.UNKNOWN_RECEIPT: 404,
    Reason.FINISHED_IN_SCOPE: 409,
    Reason.RECEIPTS_OFF: 409,
    Reason.RESULT_HELD: 409,
    Reason.MEMBERSHIP_CHANGED: 409,
    Reason.NOT_FRESH: 409,
    Reason.RESTORED_STATE_LOST: 409,
    Reason.STALE_COORDINATOR: 409,
    Reason.SANDBOX_FENCED: 409,
    Reason.SANDBOX_REFUSED: 400,
}

# Retrying the same call can succeed: the deadline was too short, admission
# reopens at resume, or a participant comes back.  Fencing and validation
# failures never heal by themselves.
_RETRYABLE = frozenset(
    {
        Reason.DEADLINE_EXCEEDED,
        Reason.ADMISSION_CLOSED,
        Reason.PARTICIPANT_UNAVAILABLE,
    }
)


class CheckpointError(Exception):
    """Root of every error ray-ckpt raises on purpose."""

    reason: Reason = Reason.INVALID_REQUEST

    def __init__(self, detail: str, *, reason: Reason | None = None) -> None:
        super().__init__(detail)
        if reason is not None:
            self.reason = reason
        self.detail = detail

    @property
    def code(self) -> str:
        return self.reason.value

    @property
    def http_status(self) -> int:
        return self.reason.http_status

    @property
    def retryable(self) -> bool:
        return self.reason.retryable

    def to_body(self) -> dict[str, Any]:
        """The JSON body every rejection carries on the wire."""
        return {"error": {"code": self.code, "detail": self.detail}}

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray pickles exceptions raised in actors; keep the reason across the hop.
        return (error_from_code, (self.code, self.detail))

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}"


class Unauthorized(CheckpointError):
    reason = Reason.UNAUTHORIZED


class InvalidRequest(CheckpointError, ValueError):
    # Also a ValueError so msgspec turns it into a ValidationError on decode.
    reason = Reason.INVALID_REQUEST
    # A FastAPI validation reply's `detail` (its list of errors), when that is
    # what the participant answered; None for our own refusals.
    validation: Any = None


class StaleCheckpoint(CheckpointError):
    reason = Reason.STALE_CHECKPOINT


class CheckpointConflict(CheckpointError):
    reason = Reason.CHECKPOINT_CONFLICT


class InvalidPhase(CheckpointError):
    reason = Reason.INVALID_PHASE


class DeadlineExceeded(CheckpointError):
    reason = Reason.DEADLINE_EXCEEDED


class StaleAttempt(CheckpointError):
    reason = Reason.STALE_ATTEMPT


class AdmissionClosed(CheckpointError):
    reason = Reason.ADMISSION_CLOSED


class RolloutIdRequired(CheckpointError):
    reason = Reason.ROLLOUT_ID_REQUIRED


class RestartInScope(CheckpointError):
    reason = Reason.RESTART_IN_SCOPE


class InvalidCheckpointState(CheckpointError):
    reason = Reason.INVALID_CHECKPOINT_STATE


class NotFound(CheckpointError):
    reason = Reason.NOT_FOUND


class MethodNotAllowed(CheckpointError):
    reason = Reason.METHOD_NOT_ALLOWED


class ParticipantUnavailable(CheckpointError):
    reason = Reason.PARTICIPANT_UNAVAILABLE


class UnknownReceipt(CheckpointError):
    """An acknowledged receipt names no result held (or acknowledged) here."""

    reason = Reason.UNKNOWN_RECEIPT


class FinishedInScope(CheckpointError):
    """A commit scope names an episode whose result is finished but unacknowledged:
    it would be both a result to deliver and work to resume."""

    reason = Reason.FINISHED_IN_SCOPE


class ResultHeld(CheckpointError):
    """A run of a rollout whose finished result is held for acknowledgement:
    it would run twice; `collect` and `ack` it (or `retire` the rollout)."""

    reason = Reason.RESULT_HELD


class MembershipChanged(CheckpointError):
    """An unattended (periodic, signal) checkpoint of a Gym that lost or
    replaced a member since its last complete checkpoint or restore."""

    reason = Reason.MEMBERSHIP_CHANGED


class RestoredStateLost(CheckpointError):
    """A restore's resume refused: a worker that held installed episodes was
    lost after the install, so those episodes cannot continue; the restore
    fails whole (retire their next attempts and start them over)."""

    reason = Reason.RESTORED_STATE_LOST


class StaleCoordinator(CheckpointError):
    """A coordinator that is no longer the newest: a participant refuses its
    control call (its epoch is older than one it has seen), or the
    coordinator itself found a newer epoch in the GCS before publishing a
    Gym manifest or `LATEST`.  Never retryable: a newer coordinator owns the Gym."""

    reason = Reason.STALE_COORDINATOR


class SandboxFenced(CheckpointError):
    """A sandbox handle of a generation a restore replaced, or of a sandbox
    already freed: its commands are refused, never run against the new one."""

    reason = Reason.SANDBOX_FENCED


class SandboxRefused(CheckpointError):
    """Input a sandbox refuses before changing anything (the subclasses say which)."""

    reason = Reason.SANDBOX_REFUSED


class SandboxPathEscape(SandboxRefused):
    """A path that would leave the sandbox: `..`, absolute, or through a
    symlink pointing outside it."""


class SandboxSpecialFile(SandboxRefused):
    """A device, socket or FIFO in a sandbox: a snapshot carries only regular
    files, directories and symlinks."""


class SandboxFileTooLarge(SandboxRefused):
    """A file over the provider's size bound (written, or found at a snapshot)."""


class SandboxUnsupported(InvalidPhase):
    """A snapshot or restore asked of a provider that declares it cannot: its
    episodes are restart-only, and the participant never asks.  On the wire
    it is `invalid_phase` (and comes back as `InvalidPhase`)."""


class ParticipantNotFresh(CheckpointError):
    """A restore refused before any participant changed anything: the named
    members have served (or restored) since they started, and a restore
    installs only into fresh processes; the fleet runs on as it was."""

    reason = Reason.NOT_FRESH


class ReceiptsOff(CheckpointError):
    """An acknowledgement reached a participant that holds no results
    (completion receipts off, or a kind that finishes no episodes)."""

    reason = Reason.RECEIPTS_OFF


class CoordinationFailed(CheckpointError):
    """A coordinated phase failed; `failures` names each participant and why."""

    reason = Reason.COORDINATION_FAILED

    def __init__(
        self,
        detail: str,
        *,
        operation: str = "",
        failures: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(detail)
        self.operation = operation
        self.failures = failures or {}

    def __reduce__(self) -> tuple[Any, ...]:
        return (_coordination_failed, (self.detail, self.operation, self.failures))

    def to_body(self) -> dict[str, Any]:
        body = super().to_body()
        body["error"]["operation"] = self.operation
        body["error"]["failures"] = self.failures
        return body


_BY_REASON: dict[Reason, type[CheckpointError]] = {
    cls.reason: cls
    for cls in (
        Unauthorized,
        InvalidRequest,
        StaleCheckpoint,
        CheckpointConflict,
        InvalidPhase,
        DeadlineExceeded,
        StaleAttempt,
        AdmissionClosed,
        RolloutIdRequired,
        RestartInScope,
        InvalidCheckpointState,
        NotFound,
        MethodNotAllowed,
        ParticipantUnavailable,
        UnknownReceipt,
        FinishedInScope,
        ReceiptsOff,
        ResultHeld,
        MembershipChanged,
        ParticipantNotFresh,
        RestoredStateLost,
        StaleCoordinator,
        SandboxFenced,
        SandboxRefused,
    )
}


def error_from_code(code: str, detail: str) -> CheckpointError:
    """Rebuild the typed error for a wire code (unknown codes keep their text)."""
    try:
        reason = Reason(code)
    except ValueError:
        return CheckpointError(f"{code}: {detail}")
    if reason is Reason.COORDINATION_FAILED:
        return CoordinationFailed(detail)
    return _BY_REASON.get(reason, CheckpointError)(detail, reason=reason)


def _coordination_failed(
    detail: str, operation: str, failures: dict[str, dict[str, Any]]
) -> CoordinationFailed:
    return CoordinationFailed(detail, operation=operation, failures=failures)


def validation_error(status: int, body: Any) -> InvalidRequest | None:
    """A FastAPI/pydantic validation reply (422 `{"detail": [...]}`, as NeMo
    Gym's control plane answers a malformed body) as `InvalidRequest`, with
    the participant's own detail kept on `.validation`; None for anything else."""
    if status != 422 or not isinstance(body, dict) or "error" in body:
        return None
    detail = body.get("detail")
    if not isinstance(detail, list | str):
        return None
    items = detail if isinstance(detail, list) else [detail]
    parts = []
    for item in items[:10]:
        if isinstance(item, dict):
            loc = ".".join(str(p) for p in item.get("loc") or [])
            parts.append(f"{item.get('type', '?')} at {loc or '?'}: {item.get('msg', '')}")
        else:
            parts.append(str(item))
    err = InvalidRequest(f"request refused by validation (HTTP 422): {'; '.join(parts)}"[:1000])
    err.validation = detail
    return err


def error_from_body(status: int, body: Any) -> CheckpointError:
    """The typed error for a `{"error": {"code", "detail"}}` reply (or a
    FastAPI 422 `{"detail": [...]}`)."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        return error_from_code(str(err.get("code", "")), str(err.get("detail", "")))
    validation = validation_error(status, body)
    if validation is not None:
        return validation
    return CheckpointError(f"HTTP {status}: {body!r}"[:500])
