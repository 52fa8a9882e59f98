"""What a participant hands its control plane: its readiness report and its receipts.

`PrepareReport` (with its `Blocker`s) is what a participant's `report` hook
returns, and `ReportReply` the shape it goes out in; a `Receipt` names one
finished result for `ack` and `collect`.  Participants' own code (`steps`,
`workers`, the kinds in `participants`) builds them and `control` carries
them on the wire, so they live below both.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ray_ckpt.identity import EpisodeId, RolloutIdStr, validate_rollout_id

# The most blockers a report lists (the count says how many there were).
MAX_REPORTED_BLOCKERS = 100


class Blocker(msgspec.Struct, frozen=True, kw_only=True):
    """One execution that keeps a participant from being ready."""

    key: str  # capture key (or a label for non-episode work)
    state: str  # running, wait_step, retiring, streaming, ...
    step: int | None = None
    mode: str | None = None
    running_s: float | None = None
    detail: str = ""


class PrepareReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a participant's `report(limit)` hook returns (in process).

    `blockers` here are the rich objects; on the wire (`wire()`) they go out
    as NeMo Gym's capture-key strings under `blockers` and as objects under
    `blocker_details`.
    """

    ready: bool
    blockers: list[Blocker] = msgspec.field(default_factory=list)
    blocker_count: int = 0
    counts: dict[str, int] = msgspec.field(default_factory=dict)
    restarts: list[str] = msgspec.field(default_factory=list)

    def wire(self) -> ReportReply:
        # Capped here too, whatever limit the hook honoured; the count is
        # never below what was listed.
        listed = self.blockers[:MAX_REPORTED_BLOCKERS]
        return ReportReply(
            ready=self.ready,
            blockers=[b.key for b in listed],
            blocker_count=max(self.blocker_count, len(self.blockers)),
            counts=dict(self.counts),
            restarts=list(self.restarts),
            blocker_details=list(listed),
        )


class ReportReply(msgspec.Struct, frozen=True, kw_only=True):
    """`report` in status and prepare replies, in NeMo Gym's shape.

    `blockers` are capture-key strings because NeMo Gym's controller turns
    each one back into an episode (`EpisodeId.from_capture_key`) to retire
    it; `blocker_details` carries our per-blocker objects, same cap and order.
    """

    ready: bool
    blockers: list[str]
    blocker_count: int
    counts: dict[str, int]
    restarts: list[str]
    blocker_details: list[Blocker]


# --- completion receipts (`ray_ckpt.steps.receipts`) ------------------------

DigestStr = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}\Z")]


class Receipt(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Names one finished result: its episode attempt and the sha256 of its
    JSON (keys sorted), so an acknowledgement is for exactly that result."""

    rollout_id: RolloutIdStr
    attempt: Annotated[int, msgspec.Meta(ge=0)] = 0
    digest: DigestStr

    def __post_init__(self) -> None:
        validate_rollout_id(self.rollout_id)  # the reserved -a<N> suffix too

    @property
    def episode(self) -> EpisodeId:
        return EpisodeId(self.rollout_id, self.attempt)

    @property
    def key(self) -> str:
        """For messages: the capture key and the digest's head."""
        return f"{self.episode.capture_key}@{self.digest[:12]}"
