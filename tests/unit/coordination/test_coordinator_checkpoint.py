"""Coordinator checkpoint logic over in-process participants (no Ray)."""

from __future__ import annotations

import asyncio
import json
import pathlib
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
import pytest

from coordination.engine.journal import Journal
from coordination.reach.hosts import FakePauseTarget
from ray_ckpt.control.wire import CheckpointRequest
from ray_ckpt.errors import (
    CheckpointConflict,
    CoordinationFailed,
    InvalidCheckpointState,
    InvalidPhase,
    StaleCheckpoint,
)
from ray_ckpt.identity import EpisodeId
from ray_ckpt.settings import CheckpointSettings
from tests.unit.coordination.coord_fleet import FAST, Fleet, make_fleet
from tests.unit.helpers import until

ORDER = ["environment/env", "model/policy", "agent/agent", "resources/res"]


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = make_fleet()
    yield f
    await f.aclose()


async def test_checkpoint_prepares_in_order_commits_everywhere_resumes_in_reverse(
    fleet: Fleet,
) -> None:
    fleet.parts["environment/env"].start("r1", at_boundary=True, state={"step": 3})
    result = await fleet.core.checkpoint("/ck", [EpisodeId("r1")])
    assert fleet.events("prepare") == ORDER
    assert sorted(fleet.events("commit")) == sorted(ORDER)
    assert fleet.events("resume") == list(reversed(ORDER))
    # Each prepare group answered before the next one was called.
    sequence = [(ev, who) for _, ev, who, op in fleet.log if op == "prepare"]
    assert sequence == [(ev, who) for who in ORDER for ev in ("call", "reply")]
    assert set(fleet.phases().values()) == {"idle"}
    assert result.episode_ids["environment/env"] == ["r1"]
    assert set(result.timings) == set(ORDER)
    assert set(result.timings["agent/agent"]) == {"prepare", "commit"}
    assert result.resume_s is not None
    assert result.total_s >= result.prepare_s
    # The Gym manifest is written last, with every participant's manifest.
    [(d, cid, manifests)] = fleet.manifests
    assert (d, cid) == ("/ck", result.checkpoint_id)
    assert sorted(m["kind"] for m in manifests) == [
        "agent",
        "environment",
        "model",
        "resources",
    ]


async def test_calls_within_a_group_go_out_together(fleet: Fleet) -> None:
    f = make_fleet(("environment/a", "environment/b", "environment/c", "agent/x"))
    try:
        for key in ("environment/a", "environment/b", "environment/c"):
            f.hosts[key].delay["prepare"] = 0.2
        await f.core.prepare()
        # Told by the order of events, not by a time: every member of the
        # group is called before any of them answers.
        events = [ev for _, ev, who, op in f.log if op == "prepare" and who.startswith("env")]
        assert events == ["call"] * 3 + ["reply"] * 3
        await f.core.resume()
    finally:
        await f.aclose()


async def test_an_unready_participant_fails_prepare_naming_its_blockers(fleet: Fleet) -> None:
    fleet.parts["agent/agent"].start("stuck-1")
    with pytest.raises(CoordinationFailed) as info:
        await fleet.core.checkpoint("/ck")
    err = info.value
    assert err.operation == "prepare"
    assert set(err.failures) == {"agent/agent"}
    assert err.failures["agent/agent"]["blockers"] == ["stuck-1"]
    assert "agent/agent" in str(err)
    assert "stuck-1" in str(err)
    # Stopped at the first unready group; everyone resumed, in reverse order.
    assert fleet.events("prepare") == ORDER[:3]
    assert fleet.events("resume") == list(reversed(ORDER))
    assert set(fleet.phases().values()) == {"idle"}
    assert fleet.manifests == []
    # Even the participant the prepare never reached refuses a delayed prepare.
    await fleet.core.settle_journal()  # the close's clear runs after the reply
    cid = fleet.core.journal.load()
    assert cid is None
    assert fleet.core.open is None
    stale_id = fleet.hosts["resources/res"].calls[-1][1]["checkpoint_id"]
    with pytest.raises(StaleCheckpoint):
        await fleet.ctrls["resources/res"].prepare(
            CheckpointRequest(checkpoint_id=stale_id, deadline_ts=time.time() + 5)
        )


async def test_a_participant_that_never_answers_is_cancelled_and_named(fleet: Fleet) -> None:
    fleet.hosts["model/policy"].hang.add("prepare")
    with pytest.raises(CoordinationFailed) as info:
        await fleet.core.checkpoint("/ck")
    assert info.value.failures["model/policy"]["code"] == "deadline_exceeded"
    assert fleet.events("prepare", "cancelled") == ["model/policy"]
    assert fleet.events("prepare") == ORDER[:2]
    assert set(fleet.phases().values()) == {"idle"}


async def test_a_dead_participant_fails_prepare_and_resume_continues_past_it(
    fleet: Fleet,
) -> None:
    fleet.hosts["agent/agent"].dead = True
    with pytest.raises(CoordinationFailed) as info:
        await fleet.core.checkpoint("/ck")
    assert info.value.failures["agent/agent"]["code"] == "participant_unavailable"
    # Resume went on past the dead agent to the ones before it in prepare order.
    assert fleet.events("resume") == list(reversed(ORDER))
    alive = {k: v for k, v in fleet.phases().items() if k != "agent/agent"}
    assert set(alive.values()) == {"idle"}


async def test_a_refused_commit_aborts_and_writes_no_gym_manifest(fleet: Fleet) -> None:
    fleet.hosts["resources/res"].fail["commit"] = InvalidCheckpointState("disk full")
    with pytest.raises(CoordinationFailed) as info:
        await fleet.core.checkpoint("/ck")
    assert info.value.operation == "commit"
    assert info.value.failures["resources/res"] == {
        "code": "invalid_checkpoint_state",
        "detail": "disk full",
    }
    assert fleet.manifests == []
    assert set(fleet.phases().values()) == {"idle"}
    assert fleet.core.open is None


async def test_full_mode_pauses_trainer_and_assembler_from_prepare_to_resume(
    fleet: Fleet,
) -> None:
    for role in ("trainer", "assembler"):
        fleet.core.register_pause(FakePauseTarget(role, log=fleet.log), mode="full")
    await fleet.core.checkpoint("/ck")
    seq = [(ev, who) for _, ev, who, _ in fleet.log if ev in ("pause", "resume", "call")]
    first_prepare = seq.index(("call", "environment/env"))
    assert seq[:first_prepare] == [("pause", "assembler"), ("pause", "trainer")]
    last_resume = max(
        i for i, (ev, who) in enumerate(seq) if (ev, who) == ("call", "environment/env")
    )
    assert seq[last_resume + 1 :] == [("resume", "trainer"), ("resume", "assembler")]


async def test_barrier_mode_pauses_the_trainer_only_around_commit(fleet: Fleet) -> None:
    fleet.core.register_pause(FakePauseTarget("trainer", log=fleet.log), mode="barrier")
    fleet.core.register_pause(FakePauseTarget("assembler", log=fleet.log))
    await fleet.core.checkpoint("/ck")
    seq = [
        (ev, who if ev in ("pause", "resume") else op)
        for _, ev, who, op in fleet.log
        if ev in ("pause", "resume") or (ev == "call" and who == "environment/env")
    ]
    assert seq == [
        ("pause", "assembler"),
        ("call", "prepare"),
        ("pause", "trainer"),
        ("call", "commit"),
        ("resume", "trainer"),
        ("call", "resume"),
        ("resume", "assembler"),
    ]


async def test_controllers_are_resumed_when_the_checkpoint_fails(fleet: Fleet) -> None:
    trainer, assembler = FakePauseTarget("trainer"), FakePauseTarget("assembler")
    fleet.core.register_pause(trainer)
    fleet.core.register_pause(assembler)
    fleet.parts["environment/env"].start("busy")
    with pytest.raises(CoordinationFailed):
        await fleet.core.checkpoint("/ck")
    assert trainer.paused is None
    assert assembler.paused is None
    assert [e[1] for e in trainer.log] == ["pause", "resume"]


async def test_a_failing_pause_aborts_before_any_participant_is_prepared(fleet: Fleet) -> None:
    trainer = FakePauseTarget("trainer")
    trainer.fail_pause = InvalidPhase("optimizer step in progress")
    fleet.core.register_pause(trainer)
    with pytest.raises(CoordinationFailed) as info:
        await fleet.core.checkpoint("/ck")
    assert set(info.value.failures) == {"trainer"}
    assert fleet.events("prepare") == []
    assert [e[1] for e in trainer.log] == ["pause", "resume"]


async def test_split_calls_keep_the_checkpoint_open_and_refuse_retire(fleet: Fleet) -> None:
    fleet.parts["environment/env"].start("r1", at_boundary=True)
    prepared = await fleet.core.prepare()
    with pytest.raises(CheckpointConflict):
        await fleet.core.prepare()
    await fleet.core.commit("/ck", [EpisodeId("r1")])
    assert set(fleet.phases().values()) == {"committed"}
    with pytest.raises(InvalidPhase):
        await fleet.core.retire([EpisodeId("r1")])
    resumed = await fleet.core.resume()
    assert resumed.checkpoint_id == prepared.checkpoint_id
    assert resumed.failures == {}
    assert (await fleet.core.resume()).checkpoint_id is None  # idempotent
    # Straggler path: resume, retire (fresh operation ID), checkpoint again.
    retired = await fleet.core.retire([EpisodeId("r1")])
    assert retired.operation_id != prepared.checkpoint_id
    assert retired.retired["environment/env"] == ["r1"]
    assert fleet.events("retire") == [
        "environment/env",
        "agent/agent",
        "model/policy",
        "resources/res",
    ]
    forgot = await fleet.core.forget(["r1"])
    assert forgot.forgotten["environment/env"] == ["r1"]
    await fleet.core.checkpoint("/ck2")


async def test_the_journal_is_written_before_each_fan_out(tmp_path: pathlib.Path) -> None:
    f = make_fleet(state_dir=str(tmp_path))
    seen: list[str] = []
    original = f.hosts["environment/env"].call

    async def spy(op: str, body: Mapping[str, Any]) -> dict[str, Any]:
        if op in ("prepare", "commit", "resume"):
            data = json.loads((tmp_path / "coordinator-state.json").read_text())
            assert data["checkpoint_id"] == body["checkpoint_id"]
            seen.append(f"{op}:{data['phase']}")
        return await original(op, body)

    writes: list[str] = []
    journal_write = f.core.journal.write

    def counting_write(data: bytes) -> None:
        writes.append(json.loads(data)["phase"])
        journal_write(data)

    f.hosts["environment/env"].call = spy  # type: ignore[method-assign]  # a spy on one host
    f.core.journal.write = counting_write  # type: ignore[method-assign]  # counts the writes
    try:
        await f.core.checkpoint("/ck")
        # Once per checkpoint: every later phase ("prepared", "committing",
        # "committed", "resuming") recovers as "preparing" does (a new
        # coordinator resumes everyone), so they stay in memory.
        assert seen == ["prepare:preparing", "commit:preparing", "resume:preparing"]
        assert writes == ["preparing"]
        await f.core.settle_journal()  # the clear runs after the reply
        assert not (tmp_path / "coordinator-state.json").exists()
    finally:
        await f.aclose()


async def test_the_journal_clear_follows_the_reply_and_precedes_the_next_entry(
    tmp_path: pathlib.Path,
) -> None:
    """The clear after a resume is not waited for by the caller, but the next
    checkpoint's entry is written only after it: never cleared by a late clear."""
    import threading

    f = make_fleet(state_dir=str(tmp_path))
    order: list[str] = []
    release = threading.Event()
    real_write, real_clear = f.core.journal.write, f.core.journal.clear

    def slow_clear() -> None:
        release.wait(10)
        real_clear()
        order.append("clear")

    def write(data: bytes) -> None:
        real_write(data)
        order.append(json.loads(data)["phase"])

    f.core.journal.clear = slow_clear  # type: ignore[method-assign]  # a clear that waits
    f.core.journal.write = write  # type: ignore[method-assign]  # notes the writes
    try:
        await asyncio.wait_for(f.core.checkpoint("/ck"), 5)  # answered, clear pending
        assert order == ["preparing"]
        second = asyncio.ensure_future(f.core.checkpoint("/ck2"))
        await asyncio.sleep(0.2)
        assert not second.done()  # waiting for the clear, nobody paused yet
        assert order == ["preparing"]
        assert f.events("prepare") == ORDER  # the first checkpoint's only
        release.set()
        await asyncio.wait_for(second, 5)
        # The second entry after the first clear; the second's own clear is
        # not waited for by its caller, so it may have landed already.
        assert order[:3] == ["preparing", "clear", "preparing"]
        await f.core.settle_journal()
        assert order == ["preparing", "clear", "preparing", "clear"]
        assert not (tmp_path / "coordinator-state.json").exists()
    finally:
        release.set()
        await f.aclose()


async def test_a_new_coordinator_aborts_what_the_old_one_left_open(tmp_path: pathlib.Path) -> None:
    old = make_fleet(state_dir=str(tmp_path))
    try:
        prepared = await old.core.prepare()
        assert set(old.phases().values()) == {"prepared"}
        # A second coordinator over the same state directory and participants.
        from coordination.engine.coordinator_core import CoordinatorCore

        new = CoordinatorCore(journal=Journal(str(tmp_path)), timeouts=FAST)
        for host in old.hosts.values():
            new.register(host)
        assert await new.recover() == prepared.checkpoint_id
        assert set(old.phases().values()) == {"idle"}
        assert await new.recover() is None  # nothing left to recover
        # The old coordinator's delayed commit is refused by fencing.
        with pytest.raises(StaleCheckpoint):
            await old.hosts["agent/agent"].call(
                "commit",
                {
                    "checkpoint_id": prepared.checkpoint_id,
                    "deadline_ts": time.time() + 5,
                    "checkpoint_dir": "/ck",
                },
            )
    finally:
        await old.aclose()


async def test_the_renewer_extends_leases_while_a_checkpoint_stays_open() -> None:
    f = make_fleet(timeouts=msgspec.structs.replace(FAST, renew_every_s=0.05))
    try:
        await f.core.prepare()
        # Polled, not slept: a loaded machine may delay the renewer's rounds.
        await until(lambda: len(f.events("renew")) >= 8)  # ≥ 2 rounds of 4
        await f.core.resume()
        count = len(f.events("renew"))
        await asyncio.sleep(0.15)
        assert len(f.events("renew")) == count, "renewing stops at resume"
    finally:
        await f.aclose()


async def test_status_lists_every_participant(fleet: Fleet) -> None:
    fleet.parts["agent/agent"].start("r9")
    fleet.hosts["resources/res"].dead = True
    status = await fleet.core.status()
    rows = {r.participant: r for r in status.participants}
    assert set(rows) == set(ORDER)
    assert rows["agent/agent"].blockers == ["r9"]
    assert rows["agent/agent"].phase == "idle"
    assert rows["resources/res"].error is not None
    assert status.open_checkpoint is None


async def test_the_renewer_keeps_short_leases_alive_whatever_renew_every_s() -> None:
    # Participants with a 0.5 s grace; the coordinator's periodic renew is an hour
    # away: it must still renew before the last deadline it sent passes.
    f = make_fleet(timeouts=msgspec.structs.replace(FAST, resume_s=0.5))
    short = CheckpointSettings(enabled=True, control_auth_token="t", lease_grace_seconds=0.5)
    for c in f.ctrls.values():
        c.settings = short
        c.start()
    try:
        await f.core.prepare()
        await f.core.commit("/ck", None)
        await asyncio.sleep(2.5)  # well past commit's deadline + the grace
        assert set(f.phases().values()) == {"committed"}, f.phases()
        assert f.events("renew")
        await f.core.resume()
        assert set(f.phases().values()) == {"idle"}
    finally:
        await f.aclose()


async def test_latest_follows_the_gym_manifest_before_the_checkpoint_returns(
    fleet: Fleet,
) -> None:
    """LATEST is written while the Gym resumes (off the pause), yet before the
    call returns, and only once the Gym manifest is; a commit that does not
    resume writes it itself; a failed checkpoint writes none."""
    res = await fleet.core.checkpoint("/ck/a", [EpisodeId("r1")])
    assert fleet.latests == [("/ck/a", res.checkpoint_id)]
    assert [m[1] for m in fleet.manifests] == [res.checkpoint_id]
    held = await fleet.core.checkpoint("/ck/b", [EpisodeId("r1")], resume=False)
    assert fleet.latests[-1] == ("/ck/b", held.checkpoint_id)
    await fleet.core.resume()
    fleet.parts["agent/agent"].start("stuck-1")  # never at a boundary: prepare fails
    with pytest.raises(CoordinationFailed):
        await fleet.core.checkpoint("/ck/c", [EpisodeId("r1")])
    assert len(fleet.latests) == 2


async def test_participant_folders_are_made_before_the_pause_from_the_last_manifests(
    fleet: Fleet, tmp_path: pathlib.Path
) -> None:
    """The second checkpoint finds each member's (kind, instance) in the first's
    manifests and creates their folders before prepare (this fleet's store is
    in memory, so only the coordinator can have made them)."""
    await fleet.core.checkpoint(str(tmp_path / "first"), [EpisodeId("r1")])
    assert not (tmp_path / "first").exists()
    assert sorted(fleet.core.layout) == sorted(ORDER)
    await fleet.core.checkpoint(str(tmp_path / "second"), [EpisodeId("r1")])
    made = sorted(
        str(p.relative_to(tmp_path / "second" / "gym"))
        for p in (tmp_path / "second" / "gym").glob("*/*")
    )
    assert made == sorted(f"{kind}/{instance}" for kind, instance in fleet.core.layout.values())
    assert len(made) == len(ORDER)
