"""Whatever raises in a prepare, a commit or their abort, nothing stays open (no Ray).

Each test injects an exception that is a bug of ours, not a participant's
refusal (a `RuntimeError`), at one step of a phase, and optionally a second
one at one step of the failure path that follows (journal, the resume
fan-out, unpausing the trainer's actors, stopping the renewer, clearing the
journal).  Afterwards every participant is idle, the core has no open
checkpoint, and the next checkpoint succeeds (no `checkpoint_conflict ... is
open (preparing)`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest

import coordination.engine.coordinator_core as phase_driver
from coordination.engine.journal import JournalEntry
from coordination.engine.pause import ControllerPauses
from coordination.engine.renewer import LeaseRenewer
from coordination.reach.hosts import FakePauseTarget
from ray_ckpt.errors import CoordinationFailed
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import Fleet, make_fleet


class Bug(RuntimeError):
    """An exception no participant ever raises: the coordinator's own bug."""


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = make_fleet()
    f.parts["environment/env"].start("r1", at_boundary=True, state={"step": 1})
    yield f
    await f.aclose()


Fault = Callable[[Fleet, pytest.MonkeyPatch], None]


def fan_out_raises(op: str, *, after: int = 0) -> Fault:
    """The fan-out itself raises for `op` (after `after` successful groups)."""

    def install(fleet: Fleet, mp: pytest.MonkeyPatch) -> None:
        # Chained: a second fault on another op wraps the first.
        real = getattr(phase_driver, "fan_out")  # noqa: B009 - not re-exported
        seen = {"n": 0}

        async def fan_out(group: Any, o: str, body: Any, timeout_s: float) -> Any:
            if o == op:
                seen["n"] += 1
                if seen["n"] > after:
                    raise Bug(f"fan-out of {o}")
            return await real(group, o, body, timeout_s)

        mp.setattr(phase_driver, "fan_out", fan_out)

    return install


def journal_raises(phase: str | None) -> Fault:
    """Journalling `phase` raises (None: clearing the journal raises)."""

    def install(fleet: Fleet, mp: pytest.MonkeyPatch) -> None:
        journal = fleet.core.journal
        real_write, real_clear = journal.write, journal.clear

        def write(data: bytes) -> None:
            # The driver encodes on the loop and writes the bytes from a thread.
            if msgspec.json.decode(data, type=JournalEntry).phase == phase:
                raise Bug(f"journal {phase}")
            real_write(data)

        def clear() -> None:
            if phase is None:
                raise Bug("journal clear")
            real_clear()

        mp.setattr(journal, "write", write)
        mp.setattr(journal, "clear", clear)

    return install


def pause_raises(fleet: Fleet, mp: pytest.MonkeyPatch) -> None:
    target = FakePauseTarget("assembler")

    async def pause(checkpoint_id: str, deadline_s: float) -> Any:
        raise Bug("pause")

    mp.setattr(target, "pause", pause)
    fleet.core.register_pause(target)


def unpause_raises(fleet: Fleet, mp: pytest.MonkeyPatch) -> None:
    async def unpause(self: ControllerPauses, cid: str, roles: Any = None) -> Any:
        raise Bug("unpause")

    mp.setattr(ControllerPauses, "unpause", unpause)


def renewer_stop_raises(fleet: Fleet, mp: pytest.MonkeyPatch) -> None:
    def stop(self: LeaseRenewer) -> None:
        raise Bug("renewer stop")

    mp.setattr(LeaseRenewer, "stop", stop)


def manifest_writer_raises(fleet: Fleet, mp: pytest.MonkeyPatch) -> None:
    def writer(d: str, cid: str, ms: list[dict[str, Any]]) -> None:
        raise Bug("gym manifest")

    mp.setattr(fleet.core, "manifest_writer", writer)


def no_fault(fleet: Fleet, mp: pytest.MonkeyPatch) -> None:
    return None


# A checkpoint journals only "preparing" (the phases after it recover the
# same way), so that and the clear are the journal writes that can fail.
ABORT_FAULTS: dict[str, Fault] = {
    "none": no_fault,
    "resume-fan-out": fan_out_raises("resume"),
    "resume-fan-out-later-group": fan_out_raises("resume", after=1),
    "unpause": unpause_raises,
    "renewer-stop": renewer_stop_raises,
    "journal-clear": journal_raises(None),
}
PREPARE_FAULTS: dict[str, Fault] = {
    "pause": pause_raises,
    "journal-preparing": journal_raises("preparing"),
    "first-group": fan_out_raises("prepare"),
    "second-group": fan_out_raises("prepare", after=1),
}
COMMIT_FAULTS: dict[str, Fault] = {
    "commit-fan-out": fan_out_raises("commit"),
    "gym-manifest": manifest_writer_raises,
}


async def assert_closed_and_usable(fleet: Fleet, mp: pytest.MonkeyPatch) -> None:
    assert fleet.core.open is None
    assert fleet.core.frozen == {}
    assert set(fleet.phases().values()) == {"idle"}
    mp.undo()  # the bug is fixed: the next checkpoint must work
    result = await fleet.core.checkpoint("/ck2", [EpisodeId("r1")])
    assert result.episode_ids["environment/env"] == ["r1"]
    assert set(fleet.phases().values()) == {"idle"}


@pytest.mark.parametrize("abort_fault", ABORT_FAULTS, ids=str)
@pytest.mark.parametrize("prepare_fault", PREPARE_FAULTS, ids=str)
async def test_a_bug_in_prepare_or_its_abort_never_leaves_the_checkpoint_open(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, prepare_fault: str, abort_fault: str
) -> None:
    PREPARE_FAULTS[prepare_fault](fleet, monkeypatch)
    ABORT_FAULTS[abort_fault](fleet, monkeypatch)
    with pytest.raises(Bug):
        await fleet.core.prepare(1.0)
    touched = {who for _, ev, who, op in fleet.log if op == "prepare" and ev == "call"}
    resumed = {who for _, ev, who, op in fleet.log if op == "resume" and ev == "reply"}
    assert touched <= resumed
    await assert_closed_and_usable(fleet, monkeypatch)


@pytest.mark.parametrize("abort_fault", ABORT_FAULTS, ids=str)
@pytest.mark.parametrize("commit_fault", COMMIT_FAULTS, ids=str)
async def test_a_bug_in_commit_or_its_abort_never_leaves_the_checkpoint_open(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, commit_fault: str, abort_fault: str
) -> None:
    await fleet.core.prepare(1.0)
    COMMIT_FAULTS[commit_fault](fleet, monkeypatch)
    ABORT_FAULTS[abort_fault](fleet, monkeypatch)
    with pytest.raises((Bug, CoordinationFailed)) as info:
        await fleet.core.commit("/ck", [EpisodeId("r1")])
    # The manifest writer's failure is reported typed; the others propagate as they are.
    if isinstance(info.value, CoordinationFailed):
        assert commit_fault == "gym-manifest"
        assert "Bug('gym manifest')" in info.value.failures["gym-manifest"]["detail"]
    await assert_closed_and_usable(fleet, monkeypatch)


async def test_a_non_checkpoint_error_from_one_controller_still_resumes_the_other(
    fleet: Fleet,
) -> None:
    trainer, assembler = FakePauseTarget("trainer"), FakePauseTarget("assembler")
    fleet.core.register_pause(trainer)
    fleet.core.register_pause(assembler)

    async def resume(checkpoint_id: str) -> Any:
        raise Bug("trainer resume")

    trainer.resume = resume  # type: ignore[method-assign]
    fleet.parts["environment/env"].start("r9")  # never reaches a boundary
    with pytest.raises(CoordinationFailed):
        await fleet.core.prepare(0.3)
    assert assembler.paused is None
    assert fleet.core.open is None
    assert set(fleet.phases().values()) == {"idle"}


RESTORE_FAULTS: dict[str, Fault] = {
    "journal-restoring": journal_raises("restoring"),
    "restore-fan-out": fan_out_raises("restore"),
    "journal-restored": journal_raises("restored"),
}
UNDO_FAULTS: dict[str, Fault] = {
    "none": no_fault,
    "cleanup-retire-fan-out": fan_out_raises("retire"),
    "resume-fan-out": fan_out_raises("resume"),
    "journal-clear": journal_raises(None),
}


@pytest.mark.parametrize("undo_fault", UNDO_FAULTS, ids=str)
@pytest.mark.parametrize("restore_fault", RESTORE_FAULTS, ids=str)
async def test_a_bug_in_restore_or_its_undo_never_leaves_a_participant_restored(
    monkeypatch: pytest.MonkeyPatch, restore_fault: str, undo_fault: str
) -> None:
    source = make_fleet()
    for key in source.parts:
        source.parts[key].start("r1", at_boundary=True, state={"at": key})
    await source.core.checkpoint("/ck", [EpisodeId("r1")])
    await source.aclose()
    fleet = make_fleet(store=source.store)
    try:
        RESTORE_FAULTS[restore_fault](fleet, monkeypatch)
        UNDO_FAULTS[undo_fault](fleet, monkeypatch)
        with pytest.raises(Bug):
            await fleet.core.restore("/ck", [EpisodeId("r1")])
        assert fleet.core.open is None
        assert set(fleet.phases().values()) == {"idle"}
        if undo_fault != "cleanup-retire-fan-out":
            # The next attempts were retired everywhere: nothing kept.
            assert all(p.restored == {} for p in fleet.parts.values())
        touched = {who for _, ev, who, op in fleet.log if op == "restore" and ev == "call"}
        resumed = {who for _, ev, who, op in fleet.log if op == "resume" and ev == "reply"}
        assert touched <= resumed
    finally:
        await fleet.aclose()
