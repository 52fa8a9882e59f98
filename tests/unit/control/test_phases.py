import pytest

from ray_ckpt.control.phase_machine import (
    RESUMED_IDS_KEPT,
    TRANSITIONS,
    ControlState,
    Effect,
    Event,
    IllegalTransition,
    Phase,
)
from ray_ckpt.errors import CheckpointConflict, InvalidPhase, StaleCheckpoint


def test_happy_path_and_effects() -> None:
    s = ControlState()
    t = s.fire(Event.PREPARE, "c1")
    assert (t.after, t.effects) == (Phase.PREPARING, (Effect.CLOSE_ADMISSION,))
    s.fire(Event.READY)
    s.fire(Event.COMMIT)
    assert s.phase is Phase.COMMITTED and s.checkpoint_id == "c1"
    t = s.fire(Event.RESUME)
    assert t.after is Phase.IDLE and Effect.OPEN_ADMISSION in t.effects
    assert t.checkpoint_id == "c1"
    assert s.checkpoint_id is None and s.is_resumed("c1")


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("event", list(Event))
def test_every_pair_is_in_the_table_or_raises(phase: Phase, event: Event) -> None:
    s = ControlState(phase=phase, checkpoint_id=None if phase is Phase.IDLE else "c")
    if (phase, event) in TRANSITIONS:
        assert s.fire(event, "c").after is TRANSITIONS[(phase, event)][0]
    else:
        with pytest.raises(IllegalTransition) as info:
            s.fire(event, "c")
        assert phase.value in str(info.value) and event.value in str(info.value)
        assert isinstance(info.value, InvalidPhase)
        assert s.phase is phase  # nothing changed


def test_fence_order_stale_then_conflict_then_phase() -> None:
    s = ControlState()
    s.fire(Event.PREPARE, "old")
    s.fire(Event.RESUME)
    s.fire(Event.PREPARE, "new")
    with pytest.raises(StaleCheckpoint):
        s.admit("commit", "old")  # stale beats conflict and phase
    with pytest.raises(CheckpointConflict):
        s.admit("commit", "other")  # conflict beats phase
    with pytest.raises(InvalidPhase):
        s.admit("commit", "new")  # preparing, not prepared


def test_cached_replies_replay_and_clear_on_resume() -> None:
    s = ControlState()
    s.fire(Event.PREPARE, "c")
    s.fire(Event.READY)
    s.cache("prepare", "c", {"phase": "prepared"})
    assert s.admit("prepare", "c") == {"phase": "prepared"}
    s.fire(Event.RESUME)
    assert s.results == {}


def test_last_64_resumed_ids_are_remembered_fifo() -> None:
    s = ControlState()
    for i in range(RESUMED_IDS_KEPT + 1):
        s.remember_resumed(f"c{i}")
    assert not s.is_resumed("c0")
    assert s.is_resumed("c1") and s.is_resumed(f"c{RESUMED_IDS_KEPT}")
    assert len(s.resumed) == RESUMED_IDS_KEPT


def test_lease_arithmetic_exact() -> None:
    s = ControlState()
    assert s.renew(100.0, 10.0) is None  # idle: no lease
    s.fire(Event.PREPARE, "c")
    assert s.renew(100.0, 10.0) == 110.0
    assert s.renew(90.0, 10.0) == 110.0  # never shortened
    assert not s.lease_expired(109.999)
    assert s.lease_expired(110.0)
    s.fire(Event.LEASE_EXPIRED)
    assert s.phase is Phase.IDLE and s.is_resumed("c") and s.lease_expires_at is None


def test_retire_allowed_only_idle_or_restored() -> None:
    s = ControlState()
    assert s.admit("retire", "r1") is None
    s.fire(Event.PREPARE, "c")
    for phase in (Phase.PREPARING, Phase.PREPARED, Phase.COMMITTED):
        s.phase = phase
        with pytest.raises(InvalidPhase):
            s.admit("retire", "c")
    s.phase = Phase.RESTORED
    assert s.admit("retire", "c") is None
    with pytest.raises(CheckpointConflict):
        s.admit("retire", "other")


@pytest.mark.parametrize("op", ["retire", "forget"])
def test_retire_and_forget_under_a_resumed_id_are_served_only_while_closed(op: str) -> None:
    s = ControlState()
    s.fire(Event.PREPARE, "c1")
    s.fire(Event.RESUME)
    # NeMo Gym's straggler path: resume (abort), then retire under the same ID.
    assert s.admit(op, "c1") is None
    # Everything that could reopen or overwrite the checkpoint stays fenced.
    for other in ("prepare", "renew", "commit", "restore"):
        with pytest.raises(StaleCheckpoint):
            s.admit(other, "c1")
    # Inside an open checkpoint today's rules hold: the resumed ID is stale.
    s.fire(Event.RESTORE, "c2")
    with pytest.raises(StaleCheckpoint):
        s.admit(op, "c1")
    assert s.admit(op, "c2") is None
