"""The coordinator's phase table (pure) and the engine on it: every step it
takes is in the table, an illegal one raises typed and changes nothing, and
the journal stores the enum."""

from __future__ import annotations

import pytest

from coordination.engine.coordinator_core import OpenCheckpoint
from coordination.engine.journal import Journal, JournalEntry, encode
from coordination.engine.phases import (
    TRANSITIONS,
    CoordinatorEvent,
    CoordinatorPhase,
    Effect,
    IllegalCoordinatorStep,
    step,
)
from ray_ckpt.errors import CheckpointConflict, InvalidPhase
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import make_fleet

P, E = CoordinatorPhase, CoordinatorEvent


@pytest.mark.parametrize("phase", list(P))
@pytest.mark.parametrize("event", list(E))
def test_every_pair_is_in_the_table_or_raises_typed(
    phase: CoordinatorPhase, event: CoordinatorEvent
) -> None:
    if (phase, event) in TRANSITIONS:
        done = step(phase, event)
        assert (done.before, done.after) == (phase, TRANSITIONS[(phase, event)][0])
        return
    with pytest.raises(IllegalCoordinatorStep) as info:
        step(phase, event)
    assert isinstance(info.value, InvalidPhase)
    assert info.value.to_body()["error"]["code"] == "invalid_phase"
    assert phase.value in info.value.detail and event.value in info.value.detail


def _walk(*events: CoordinatorEvent) -> list[CoordinatorPhase]:
    phase, seen = P.IDLE, []
    for event in events:
        phase = step(phase, event).after
        seen.append(phase)
    return seen


def test_the_paths_a_checkpoint_and_a_restore_take() -> None:
    sync = _walk(E.OPEN, E.PREPARED, E.COMMIT, E.PUBLISHED, E.RESUME, E.CLOSED)
    assert sync == [P.PREPARING, P.PREPARED, P.COMMITTING, P.COMMITTED, P.RESUMING, P.IDLE]
    assert _walk(E.OPEN, E.PREPARED, E.COMMIT, E.CAPTURED, E.RESUME)[-1] is P.RESUMING
    assert _walk(E.RESTORE, E.INSTALLED, E.RESUME, E.CLOSED)[-1] is P.IDLE
    assert _walk(E.RESTORE, E.UNDO, E.CLOSED)[-1] is P.IDLE
    # A restore whose resume found restored state lost is undone from there.
    assert _walk(E.RESTORE, E.INSTALLED, E.RESUME, E.UNDO, E.CLOSED)[-1] is P.IDLE
    assert _walk(E.RECOVER, E.CLOSED)[-1] is P.IDLE
    assert _walk(E.RECOVER_INSTALL, E.UNDO, E.CLOSED)[-1] is P.IDLE


def test_every_phase_closes_and_idle_only_by_closing() -> None:
    into_idle = {e for (p, e), (after, _) in TRANSITIONS.items() if after is P.IDLE}
    assert into_idle == {E.CLOSED}
    for phase in P:
        # Each open phase reaches idle: by resuming (or undoing) and closing.
        seen, frontier = {phase}, [phase]
        while frontier:
            here = frontier.pop()
            for (p, _), (after, _) in TRANSITIONS.items():
                if p is here and after not in seen:
                    seen.add(after)
                    frontier.append(after)
        assert P.IDLE in seen, phase


def test_what_is_journalled_before_a_fan_out() -> None:
    # Recovery depends on the opening and on a restore's progress; a
    # checkpoint's later steps recover the same way, so they are only noted.
    assert Effect.JOURNAL in step(P.IDLE, E.OPEN).effects
    assert Effect.JOURNAL in step(P.IDLE, E.RESTORE).effects
    assert Effect.JOURNAL in step(P.RESTORING, E.INSTALLED).effects
    assert Effect.JOURNAL not in step(P.PREPARING, E.PREPARED).effects
    assert Effect.JOURNAL not in step(P.COMMITTING, E.PUBLISHED).effects
    assert Effect.RECORD_BASELINE in step(P.COMMITTING, E.PUBLISHED).effects


def test_the_journal_stores_the_phase_enum(tmp_path: object) -> None:
    journal = Journal(str(tmp_path))
    journal.write(encode(JournalEntry(checkpoint_id="c1", phase=P.PREPARED, op="checkpoint")))
    loaded = journal.load()
    assert loaded is not None and loaded.phase is P.PREPARED
    # An entry naming a phase the table does not have is unreadable, not guessed.
    journal.write(b'{"checkpoint_id": "c1", "phase": "halfway", "op": "checkpoint"}')
    assert journal.load() is None


async def test_an_illegal_step_of_the_engine_raises_and_changes_nothing() -> None:
    fleet = make_fleet()
    try:
        with pytest.raises(CheckpointConflict, match="prepare first"):
            await fleet.core.commit("/ck", [EpisodeId("r1")])
        await fleet.core.prepare()
        oc = fleet.core.open
        assert isinstance(oc, OpenCheckpoint) and oc.phase is P.PREPARED
        with pytest.raises(IllegalCoordinatorStep):
            await oc.fire(E.INSTALLED)  # a checkpoint never installs
        assert oc.phase is P.PREPARED and fleet.core.open is oc
        with pytest.raises(CheckpointConflict):
            await fleet.core.prepare()
        assert (await fleet.core.resume()).checkpoint_id == oc.checkpoint_id
        assert fleet.core.open is None and oc.phase is P.IDLE
        assert set(fleet.phases().values()) == {"idle"}
    finally:
        await fleet.aclose()
