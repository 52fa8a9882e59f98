"""The pure phase machine: phases, one transition table, fencing, lease arithmetic.

No awaits, no clock reads, no I/O: the engine feeds it events (a control
call, readiness, a lease tick) with the current time and carries out the
effects it returns.  An illegal transition raises; nothing falls through.

```
idle --prepare--> preparing --ready--> prepared --commit--> committed
idle --restore--> restored
preparing | prepared | committed | restored --resume / lease expiry--> idle
preparing --close failed--> idle;  restored --install failed--> idle
```
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ray_ckpt.errors import CheckpointConflict, InvalidPhase, StaleCheckpoint

RESUMED_IDS_KEPT = 64


class Phase(StrEnum):
    IDLE = "idle"
    PREPARING = "preparing"
    PREPARED = "prepared"
    COMMITTED = "committed"
    RESTORED = "restored"


class Event(StrEnum):
    PREPARE = "prepare"
    READY = "ready"
    CLOSE_FAILED = "close_failed"
    RESTORE_FAILED = "restore_failed"
    COMMIT = "commit"
    RESTORE = "restore"
    RESUME = "resume"
    LEASE_EXPIRED = "lease_expired"


class Effect(StrEnum):
    CLOSE_ADMISSION = "close_admission"
    OPEN_ADMISSION = "open_admission"
    STOP_WRITES = "stop_writes"


_REOPEN = (Effect.STOP_WRITES, Effect.OPEN_ADMISSION)

TRANSITIONS: dict[tuple[Phase, Event], tuple[Phase, tuple[Effect, ...]]] = {
    (Phase.IDLE, Event.PREPARE): (Phase.PREPARING, (Effect.CLOSE_ADMISSION,)),
    (Phase.PREPARING, Event.PREPARE): (Phase.PREPARING, ()),
    # A failed close reopens admission so phase and admission never disagree.
    (Phase.PREPARING, Event.CLOSE_FAILED): (Phase.IDLE, (Effect.OPEN_ADMISSION,)),
    (Phase.PREPARING, Event.READY): (Phase.PREPARED, ()),
    (Phase.PREPARED, Event.COMMIT): (Phase.COMMITTED, ()),
    (Phase.IDLE, Event.RESTORE): (Phase.RESTORED, (Effect.CLOSE_ADMISSION,)),
    # An install that failed installed nothing: back to idle, ID not consumed.
    (Phase.RESTORED, Event.RESTORE_FAILED): (Phase.IDLE, (Effect.OPEN_ADMISSION,)),
    (Phase.PREPARING, Event.RESUME): (Phase.IDLE, _REOPEN),
    (Phase.PREPARED, Event.RESUME): (Phase.IDLE, _REOPEN),
    (Phase.COMMITTED, Event.RESUME): (Phase.IDLE, _REOPEN),
    (Phase.RESTORED, Event.RESUME): (Phase.IDLE, _REOPEN),
    # Lease expiry is exactly an abort: the participant resumes by itself.
    (Phase.PREPARING, Event.LEASE_EXPIRED): (Phase.IDLE, _REOPEN),
    (Phase.PREPARED, Event.LEASE_EXPIRED): (Phase.IDLE, _REOPEN),
    (Phase.COMMITTED, Event.LEASE_EXPIRED): (Phase.IDLE, _REOPEN),
    (Phase.RESTORED, Event.LEASE_EXPIRED): (Phase.IDLE, _REOPEN),
}

# Which phases each control operation is accepted in (after the fence checks).
ALLOWED: dict[str, frozenset[Phase]] = {
    "prepare": frozenset({Phase.IDLE, Phase.PREPARING, Phase.PREPARED}),
    "renew": frozenset({Phase.PREPARING, Phase.PREPARED, Phase.COMMITTED, Phase.RESTORED}),
    "commit": frozenset({Phase.PREPARED, Phase.COMMITTED}),
    "restore": frozenset({Phase.IDLE, Phase.RESTORED}),
    "resume": frozenset(Phase),
    # Stopping an episode waits for its cleanup, whose calls wait for resume:
    # so no retire while a checkpoint is open.
    "retire": frozenset({Phase.IDLE, Phase.RESTORED}),
    "forget": frozenset({Phase.IDLE, Phase.RESTORED}),
}


# Outside an open checkpoint these are not fenced by remembered IDs: NeMo
# Gym's straggler path is "resume (abort), then retire the blockers" under
# the same ID.  That is safe because a retire only raises marks (never
# lowers one) and a forget only drops marks of rollouts the caller is done
# with; neither can reopen or overwrite a checkpoint.
UNFENCED_WHEN_CLOSED = frozenset({"retire", "forget"})


class IllegalTransition(InvalidPhase):
    def __init__(self, phase: Phase, event: Event) -> None:
        super().__init__(f"event {event.value!r} is not legal in phase {phase.value!r}")
        self.phase = phase
        self.event = event


@dataclass(frozen=True)
class Transition:
    before: Phase
    after: Phase
    effects: tuple[Effect, ...]
    checkpoint_id: str | None


@dataclass
class ControlState:
    """One participant's control state; every method is pure bookkeeping."""

    phase: Phase = Phase.IDLE
    checkpoint_id: str | None = None
    lease_expires_at: float | None = None
    resumed: OrderedDict[str, None] = field(default_factory=OrderedDict)
    results: dict[tuple[str, str], Any] = field(default_factory=dict)

    # --- fencing ---------------------------------------------------------
    def is_resumed(self, checkpoint_id: str) -> bool:
        return checkpoint_id in self.resumed

    def admit(self, op: str, checkpoint_id: str, *, unfinished: bool = False) -> Any | None:
        """Fence a call: stale, then conflict, then phase.

        A retire or forget under a resumed ID is not stale while no checkpoint
        is open (`UNFENCED_WHEN_CLOSED`); inside an open one it is.

        Returns the cached reply of a completed identical call, else None.
        `unfinished`: the engine knows this same-ID call started and never
        answered (a commit whose release step failed, a restore whose install
        outlived its call), so a retry may join it instead of being refused as
        a different repeat.
        """
        active = self.checkpoint_id
        if checkpoint_id in self.resumed and not (op in UNFENCED_WHEN_CLOSED and active is None):
            raise StaleCheckpoint(f"checkpoint {checkpoint_id} was already resumed")
        if active is not None and active != checkpoint_id:
            raise CheckpointConflict(
                f"checkpoint {active} is open; {op} for {checkpoint_id} refused"
            )
        cached = self.results.get((checkpoint_id, op))
        if cached is not None:
            return cached
        if self.phase not in ALLOWED[op]:
            raise InvalidPhase(f"{op} is not valid in phase {self.phase.value}")
        if unfinished:
            return None
        # Same-ID repeats that are legal only as replays of a finished call.
        if op == "commit" and self.phase is Phase.COMMITTED:
            raise InvalidPhase(f"commit of {checkpoint_id} already finished differently")
        if op == "restore" and self.phase is Phase.RESTORED:
            raise InvalidPhase("this participant already restored; restore runs once")
        return None

    def cache(self, op: str, checkpoint_id: str, reply: Any) -> None:
        self.results[(checkpoint_id, op)] = reply

    def remember_resumed(self, checkpoint_id: str) -> None:
        self.resumed[checkpoint_id] = None
        self.resumed.move_to_end(checkpoint_id)
        while len(self.resumed) > RESUMED_IDS_KEPT:
            self.resumed.popitem(last=False)

    # --- transitions -----------------------------------------------------
    def fire(self, event: Event, checkpoint_id: str | None = None) -> Transition:
        key = (self.phase, event)
        if key not in TRANSITIONS:
            raise IllegalTransition(self.phase, event)
        after, effects = TRANSITIONS[key]
        before = self.phase
        ended = self.checkpoint_id
        self.phase = after
        if after is Phase.IDLE:
            if ended is not None and event in (Event.RESUME, Event.LEASE_EXPIRED):
                self.remember_resumed(ended)
            if ended is not None:
                self.results = {k: v for k, v in self.results.items() if k[0] != ended}
            self.checkpoint_id = None
            self.lease_expires_at = None
        elif checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id
        return Transition(
            before, after, effects, ended if after is Phase.IDLE else self.checkpoint_id
        )

    # --- lease -----------------------------------------------------------
    def renew(self, deadline_ts: float, grace_s: float) -> float | None:
        """Every accepted call extends the lease to deadline + grace (never shortens)."""
        if self.phase is Phase.IDLE:
            return None
        candidate = deadline_ts + grace_s
        if self.lease_expires_at is None or candidate > self.lease_expires_at:
            self.lease_expires_at = candidate
        return self.lease_expires_at

    def lease_expired(self, now: float) -> bool:
        return (
            self.phase is not Phase.IDLE
            and self.lease_expires_at is not None
            and now >= self.lease_expires_at
        )
