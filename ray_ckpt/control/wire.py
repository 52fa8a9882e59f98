"""Control-plane wire types: frozen msgspec Structs, decoders built once.

Request bodies match NeMo Gym's control routes: unknown fields are refused,
`checkpoint_id` follows the ID pattern (1-128 chars; a rollout ID may be up
to 1,024) and `deadline_ts` is the
absolute Unix-epoch deadline of the call.  New fields get defaults.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec

from ray_ckpt.errors import DeadlineExceeded, InvalidRequest
from ray_ckpt.identity import (
    ID_PATTERN,
    MAX_ID_LENGTH,
    EpisodeId,
    RolloutIdStr,
    validate_rollout_id,
)
from ray_ckpt.reports import PrepareReport, Receipt

CheckpointIdStr = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN)
]
PathStr = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
# A coordinator's fencing token (`coordination.engine.epoch`): a non-negative
# integer, bounded so that JSON carries it exactly (2**53).
EpochInt = Annotated[int, msgspec.Meta(ge=0, le=2**53)]


class CheckpointRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """prepare, renew (and the base of every other request)."""

    checkpoint_id: CheckpointIdStr
    deadline_ts: float
    # The sending coordinator's epoch: refused (`stale_coordinator`) when
    # older than the newest this participant has seen.  Optional: NeMo Gym's
    # controller sends none, and a call without one is not fenced by epoch.
    coordinator_epoch: EpochInt | None = None

    def __post_init__(self) -> None:
        if isinstance(self.deadline_ts, bool) or not math.isfinite(self.deadline_ts):
            raise InvalidRequest("deadline_ts must be a finite number of epoch seconds")

    def remaining(self, now: float) -> float:
        """Seconds left before the deadline; raises once it has passed."""
        left = self.deadline_ts - now
        if left <= 0:
            raise DeadlineExceeded(
                f"deadline of checkpoint {self.checkpoint_id} passed {-left:.3f}s ago"
            )
        return left


class CommitRequest(CheckpointRequest, frozen=True, forbid_unknown_fields=True, kw_only=True):
    checkpoint_dir: PathStr
    # The commit scope: every episode the engine continues, including a
    # restored episode whose replacement has not started (by that attempt).
    episode_ids: list[EpisodeId] | None = None
    # The engine stops instead of resuming: free external compute once durable.
    stop: bool = False
    # "async": answer `pending` once the records are captured and write them
    # after the resume (`ray_ckpt.control.background`); re-send the commit to
    # wait for durability.  NeMo Gym's controllers send none: "sync".
    durability: Literal["sync", "async"] = "sync"


class RestoreRequest(CheckpointRequest, frozen=True, forbid_unknown_fields=True, kw_only=True):
    checkpoint_dir: PathStr
    episode_ids: list[EpisodeId]


class RetireRequest(CheckpointRequest, frozen=True, forbid_unknown_fields=True, kw_only=True):
    episode_ids: Annotated[list[EpisodeId], msgspec.Meta(min_length=1)]


class ForgetRequest(CheckpointRequest, frozen=True, forbid_unknown_fields=True, kw_only=True):
    rollout_ids: Annotated[list[RolloutIdStr], msgspec.Meta(min_length=1)]

    def __post_init__(self) -> None:
        super().__post_init__()
        # The pattern alone lets `r-a1` through: the reserved -a<N> suffix is
        # refused here as on every other route that names a rollout.
        for rollout_id in self.rollout_ids:
            validate_rollout_id(rollout_id)


class ResumeRequest(CheckpointRequest, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # The coordinator's abort (a checkpoint that will never be published):
    # an asynchronous commit's captured write is then discarded, not written
    # (`ray_ckpt.control.background`).  Without it a resume follows a
    # commit every member answered, and the write goes on.  Sent only with
    # true, so a participant that predates it is never sent the field.
    abort: bool = False


REQUEST_TYPES: dict[str, type[CheckpointRequest]] = {
    "prepare": CheckpointRequest,
    "renew": CheckpointRequest,
    "resume": ResumeRequest,
    "commit": CommitRequest,
    "restore": RestoreRequest,
    "retire": RetireRequest,
    "forget": ForgetRequest,
}
OPERATIONS = tuple(REQUEST_TYPES)

_JSON_DECODERS = {op: msgspec.json.Decoder(t) for op, t in REQUEST_TYPES.items()}


def decode_request(op: str, body: bytes | str | dict[str, Any]) -> CheckpointRequest:
    """Decode and validate a request body; raises `InvalidRequest`."""
    if op not in REQUEST_TYPES:
        raise InvalidRequest(f"unknown control operation {op!r}")
    req: CheckpointRequest = _decode(op, body, REQUEST_TYPES[op], _JSON_DECODERS[op])
    return req


def _decode(op: str, body: bytes | str | dict[str, Any], typ: type, decoder: Any) -> Any:
    """`body` (JSON bytes, or a dict from the Ray transport) as `typ`, strictly."""
    try:
        if isinstance(body, dict):
            return msgspec.convert(body, typ, strict=True)
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"{op}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"{op}: malformed JSON body: {exc}") from None


# --- completion receipts (`ray_ckpt.steps.receipts`) ------------------------
# Not checkpoint phases: they carry no checkpoint ID and are never fenced, so
# they are their own operations beside `OPERATIONS` (a engine that never
# acks never sends them).

MAX_RECEIPTS_PER_ACK = 100_000


class AckRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`ack`: the trainer's data store committed these results; free them.

    `check`: only say which of them are known here (held or acknowledged),
    change nothing -- the coordinator asks every environment participant
    first, so a receipt no participant knows refuses the whole call."""

    receipts: Annotated[list[Receipt], msgspec.Meta(min_length=1, max_length=MAX_RECEIPTS_PER_ACK)]
    check: bool = False


class CollectRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`collect`: every finished, unacknowledged result held here."""


RECEIPT_REQUEST_TYPES: dict[str, type[AckRequest] | type[CollectRequest]] = {
    "ack": AckRequest,
    "collect": CollectRequest,
}
RECEIPT_OPERATIONS = tuple(RECEIPT_REQUEST_TYPES)
# Every POST route under the control prefix.
CONTROL_OPERATIONS = (*OPERATIONS, *RECEIPT_OPERATIONS)

_RECEIPT_DECODERS = {op: msgspec.json.Decoder(t) for op, t in RECEIPT_REQUEST_TYPES.items()}


def decode_receipt_request(
    op: str, body: bytes | str | dict[str, Any]
) -> AckRequest | CollectRequest:
    """Decode and validate an `ack` or `collect` body; raises `InvalidRequest`."""
    if op not in RECEIPT_REQUEST_TYPES:
        raise InvalidRequest(f"unknown receipt operation {op!r}")
    req: AckRequest | CollectRequest = _decode(
        op, body, RECEIPT_REQUEST_TYPES[op], _RECEIPT_DECODERS[op]
    )
    return req


# --- replies -----------------------------------------------------------------


def report_reply(report: PrepareReport) -> dict[str, Any]:
    """A participant's report as the plain dict a reply carries."""
    out: dict[str, Any] = msgspec.to_builtins(report.wire())
    return out


def to_builtins(value: Any) -> Any:
    """Structs to plain dicts/lists for JSON replies and Ray returns."""
    return msgspec.to_builtins(value)
