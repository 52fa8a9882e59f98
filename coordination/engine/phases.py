"""The coordinator's phase table: what it can do, and in which order (pure).

As each participant runs on `ray_ckpt.control.phase_machine`, the
coordinator's engine (`coordination.engine.coordinator_core`) runs on this: one enum of
phases, one `(phase, event) → (phase, effects)` table, and an illegal step
raises (`IllegalCoordinatorStep`, a typed `InvalidPhase`) instead of falling
through.  No awaits, no clock, no I/O: the engine fires an event and carries
out the effects it gets back.  The journal stores the phase (`JournalEntry`).

```
checkpoint:  idle --open--> preparing --prepared--> prepared --commit--> committing
             committing --published--> committed        (sync: the Gym manifest is written)
             committing --captured-->  committed        (async: publishes after the resume)
             preparing | prepared | committing | committed --resume--> resuming
restore:     idle --restore--> restoring --installed--> restored --resume--> resuming
             restoring | restored --undo--> resuming    (retire the next attempts first)
             resuming --closed--> idle
recovery:    idle --recover--> resuming                 (a journalled checkpoint, or a restore
                                                         already installed: resume everyone)
             idle --recover_install--> restoring --undo--> resuming
```
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ray_ckpt.errors import InvalidPhase


class CoordinatorPhase(StrEnum):
    IDLE = "idle"
    PREPARING = "preparing"
    PREPARED = "prepared"
    COMMITTING = "committing"
    COMMITTED = "committed"
    RESUMING = "resuming"
    RESTORING = "restoring"
    RESTORED = "restored"


class CoordinatorEvent(StrEnum):
    OPEN = "open"  # a checkpoint opens: members frozen, its prepare fans out
    PREPARED = "prepared"  # every member answered prepared
    COMMIT = "commit"  # the commit fans out (again, for a retried commit)
    PUBLISHED = "published"  # every member committed and the Gym manifest is written
    CAPTURED = "captured"  # every member captured; the writes publish after the resume
    RESTORE = "restore"  # a restore opens: members frozen, the install fans out
    INSTALLED = "installed"  # every member installed
    UNDO = "undo"  # a restore failed: the next attempts are retired everywhere
    RESUME = "resume"  # resume (or abort): participants in reverse order, then callers
    CLOSED = "closed"  # nothing open any more
    RECOVER = "recover"  # a restarted coordinator found an entry it must resume
    RECOVER_INSTALL = "recover_install"  # ... a restore that may have half-installed


class Effect(StrEnum):
    FREEZE_MEMBERS = "freeze_members"  # the members of this operation, whoever registers later
    JOURNAL = "journal"  # written durably before the next fan-out: recovery depends on it
    NOTE = "note"  # in memory only: recovery would do the same without the write
    START_RENEWER = "start_renewer"  # leases renewed while it stays open
    STOP_RENEWER = "stop_renewer"
    CLEAR_JOURNAL = "clear_journal"  # closed: the journal entry goes (not waited for)
    RECORD_BASELINE = "record_baseline"  # the Gym unattended triggers compare with


_JOURNAL = (Effect.JOURNAL,)
_NOTE = (Effect.NOTE,)
# A checkpoint's resume recovers the same way whatever its phase, so it is
# only noted; a restore's resume is journalled (its phase decides undo or resume).
_RESUME_CHECKPOINT = (Effect.NOTE,)
_RESUME_RESTORE = (Effect.JOURNAL,)
_CLOSE = (Effect.STOP_RENEWER, Effect.CLEAR_JOURNAL)

P, E = CoordinatorPhase, CoordinatorEvent
Table = dict[tuple[CoordinatorPhase, CoordinatorEvent], tuple[CoordinatorPhase, tuple[Effect, ...]]]

TRANSITIONS: Table = {
    (P.IDLE, E.OPEN): (P.PREPARING, (Effect.FREEZE_MEMBERS, Effect.JOURNAL, Effect.START_RENEWER)),
    # In memory: recovery aborts "preparing" and "prepared" alike.
    (P.PREPARING, E.PREPARED): (P.PREPARED, _NOTE),
    (P.PREPARED, E.COMMIT): (P.COMMITTING, _NOTE),
    # A commit refused before any participant wrote leaves it prepared; a
    # commit that failed after some did aborts it: so a commit may repeat.
    (P.COMMITTING, E.COMMIT): (P.COMMITTING, _NOTE),
    # The Gym manifest is the durable record of this step.
    (P.COMMITTING, E.PUBLISHED): (P.COMMITTED, (Effect.NOTE, Effect.RECORD_BASELINE)),
    (P.COMMITTING, E.CAPTURED): (P.COMMITTED, (Effect.NOTE, Effect.RECORD_BASELINE)),
    (P.PREPARING, E.RESUME): (P.RESUMING, _RESUME_CHECKPOINT),
    (P.PREPARED, E.RESUME): (P.RESUMING, _RESUME_CHECKPOINT),
    (P.COMMITTING, E.RESUME): (P.RESUMING, _RESUME_CHECKPOINT),
    (P.COMMITTED, E.RESUME): (P.RESUMING, _RESUME_CHECKPOINT),
    (P.IDLE, E.RESTORE): (P.RESTORING, (Effect.FREEZE_MEMBERS, Effect.JOURNAL)),
    (P.RESTORING, E.INSTALLED): (P.RESTORED, _JOURNAL),
    (P.RESTORING, E.UNDO): (P.RESUMING, _RESUME_RESTORE),
    (P.RESTORED, E.UNDO): (P.RESUMING, _RESUME_RESTORE),
    (P.RESTORED, E.RESUME): (P.RESUMING, (*_RESUME_RESTORE, Effect.RECORD_BASELINE)),
    # A restore's own resume that finds restored state lost undoes it after.
    (P.RESUMING, E.UNDO): (P.RESUMING, ()),
    (P.RESUMING, E.CLOSED): (P.IDLE, _CLOSE),
    (P.IDLE, E.RECOVER): (P.RESUMING, (Effect.FREEZE_MEMBERS,)),
    (P.IDLE, E.RECOVER_INSTALL): (P.RESTORING, (Effect.FREEZE_MEMBERS,)),
}

# The operations whose retire and forget may run while it is open: right
# after a restore the participants expect its ID (`CoordinatorCore.retire`).
RETIRE_OPEN = frozenset({P.RESTORED})


class IllegalCoordinatorStep(InvalidPhase):
    """The engine asked for a step its phase table does not have."""

    def __init__(self, phase: CoordinatorPhase, event: CoordinatorEvent) -> None:
        super().__init__(f"coordinator event {event.value!r} is not legal in phase {phase.value!r}")
        self.phase = phase
        self.event = event


@dataclass(frozen=True)
class Step:
    before: CoordinatorPhase
    after: CoordinatorPhase
    effects: tuple[Effect, ...]


def step(phase: CoordinatorPhase, event: CoordinatorEvent) -> Step:
    """The step `event` takes from `phase`; `IllegalCoordinatorStep` if none."""
    found = TRANSITIONS.get((phase, event))
    if found is None:
        raise IllegalCoordinatorStep(phase, event)
    after, effects = found
    return Step(phase, after, effects)
