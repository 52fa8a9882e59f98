"""Participant hooks of each kind without HTTP: cuts, ledgers, modes, all-or-nothing installs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from participants.agent import AgentParticipant
from participants.policy_model import PolicyModelParticipant
from participants.resources import ResourcesMode, ResourcesParticipant
from participants.servers.resources import GuessGame, ResourcesServer
from ray_ckpt.control.protocol import Participant
from ray_ckpt.errors import AdmissionClosed, InvalidCheckpointState
from ray_ckpt.identity import EpisodeId
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.steps import RESTART_HEADER, VERIFY_HEADER
from ray_ckpt.storage.records.record import Record

R, R1, S = EpisodeId("r"), EpisodeId("r", 1), EpisodeId("s")


def test_every_kind_is_a_participant() -> None:
    for p in (
        PolicyModelParticipant(),
        AgentParticipant(),
        ResourcesParticipant(GuessGame()),
    ):
        assert isinstance(p, Participant)


async def test_model_cuts_the_latest_undelivered_call_and_ledgers_only_delivered() -> None:
    model = PolicyModelParticipant()
    old = model.admit(R, "d-old")
    old.tokens = [1, 2]
    new = model.admit(R, "d-new")
    new.tokens = [3, 4, 5]
    empty = model.admit(S, "d-s")  # nothing generated yet: nothing worth a cut
    delivered = model.admit(EpisodeId("t"), "d-t")
    delivered.tokens = [9]
    model.deliver(delivered)
    assert not model.ready()  # a response being delivered blocks prepare
    model.close_admission()
    with pytest.raises(AdmissionClosed):
        model.admit(R, "d-later")
    assert model.cuts == {R: model.cuts[R]}
    assert (model.cuts[R].digest, model.cuts[R].tokens) == ("d-new", [3, 4, 5])
    assert model.counts["cut_skipped"] == 1
    model.delivered(delivered, {"call": delivered.index, "tokens": 1})
    assert model.ready()
    records = await model.export([R, S, EpisodeId("t")])
    by_key = {r.key: r.state for r in records}
    assert by_key["r"] == {
        "rows": [],
        "cut": {"digest": "d-new", "tokens": [3, 4, 5], "call": new.index, "params": ""},
        "progress": {"tokens": 3},  # the cut's: nothing delivered yet
    }
    assert "s" not in by_key  # undelivered and uncut: left out
    assert by_key["t"]["rows"] == [{"call": delivered.index, "tokens": 1}]
    for call in (old, new, empty):
        model.drop(call)

    fresh = PolicyModelParticipant()
    assert await fresh.install(records) == [R1, EpisodeId("t", 1)]
    fresh.open_admission()
    again = fresh.admit(R1, "d-new")
    assert again.tokens == [3, 4, 5]
    assert again.continued == 3
    # Retire frees the attempt's ledger and every earlier attempt's.
    assert await fresh.retire([EpisodeId("t", 1), R1]) == ["r-a1", "t-a1"]
    assert (fresh.calls, fresh.ledger, fresh.restored_cuts) == ({}, {}, {})


async def test_model_install_is_all_or_nothing_and_unmatched_cuts_regenerate() -> None:
    model = PolicyModelParticipant()
    good = Record("r", {"rows": [], "cut": {"digest": "d", "tokens": [1], "call": 0}})
    for bad in (Record("s", {"rows": "nope"}), Record("-x", {"rows": []}), Record("r-a1", {})):
        with pytest.raises(InvalidCheckpointState):
            await model.install([good, bad])
        assert (model.ledger, model.restored_cuts, model.fresh()) == ({}, {}, True)
    await model.install([good])
    call = model.admit(R1, "another conversation")
    assert (call.tokens, model.counts["cut_unmatched"]) == ([], 1)
    assert await model.delete_restored([]) == []  # claimed by its call


async def test_restart_only_resources_never_block_export_nothing_and_report_restarts() -> None:
    game = GuessGame()
    resources = ResourcesParticipant(game)  # the default: nobody audited it
    assert resources.mode is ResourcesMode.RESTART_ONLY
    ticket = await resources.enter(R, "guess")
    game.seed(R, "t", 1)
    resources.bind_session(R)
    resources.close_admission()
    assert resources.ready()
    assert resources.report(10).restarts == ["r"]
    assert await resources.export(None) == []
    resources.leave(ticket)
    with pytest.raises(InvalidCheckpointState):
        await ResourcesParticipant(GuessGame()).install([Record("r", {"session": {}})])


async def test_exported_resources_wait_for_counted_requests_and_install_all_or_nothing() -> None:
    game = GuessGame()
    resources = ResourcesParticipant(game, mode="exported")
    game.seed(R, "t", 1)
    resources.bind_session(R)
    ticket = await resources.enter(R, "guess")
    replay_verify = await resources.enter(S, "verify", counted=False)
    resources.close_admission()
    assert not resources.ready()
    assert [b.key for b in resources.report(10).blockers] == ["r"]
    resources.leave(ticket)
    assert resources.ready()  # the replayable verify does not count
    resources.leave(replay_verify)
    records = await resources.export([R, S])
    assert records == [Record("r", {"session": game.states[R]})]

    target_game = GuessGame()
    target = ResourcesParticipant(target_game, mode="exported")
    broken = Record("s", {"session": {"secret": 1}})
    with pytest.raises(InvalidCheckpointState):
        await target.install([*records, broken])
    assert (target_game.states, target.sessions) == ({}, set())
    assert await target.install(records) == [R1]
    assert target_game.states[R1] == game.states[R]
    assert list(target_game.states[R1]) == list(game.states[R])  # key order kept
    assert await target.delete_restored([]) == ["r-a1"]
    assert target_game.states == {}


def test_a_stateless_verifier_declares_replay_and_exports_nothing() -> None:
    server = ResourcesServer("v", mode="stateless", verify_mode="wait")
    assert server.verify_mode.value == "replay"
    exported = ResourcesServer("e", mode="exported")
    assert exported.verify_mode.value == "wait"
    restart = ResourcesServer("x", mode="restart_only")
    assert restart.stats()["mode"] == "restart_only"
    from participants.servers.resources import resources_server

    built = resources_server(name="v2", settings=CheckpointSettings(), mode="stateless")
    assert built.participant.mode is ResourcesMode.STATELESS
    assert (VERIFY_HEADER, RESTART_HEADER) == ("x-ng-checkpoint-verify", "x-ng-checkpoint-restart")


async def test_agent_install_refuses_bad_sessions_and_installs_nothing() -> None:
    good: dict[str, Any] = {
        "step": 0,
        "turn": 1,
        "done": False,
        "messages": [],
        "turns": [],
        "result": None,
    }
    agent = AgentParticipant()
    for bad in (Record("s", {"session": {"step": 0}}), Record("s", "x"), Record("r", {})):
        with pytest.raises(InvalidCheckpointState):
            await agent.install([Record("r", {"session": good}), bad])
        assert agent.sessions == {}
        assert agent.fresh()
    assert await agent.install([Record("r", {"session": good})]) == [R1]
    agent.close_admission()
    assert await agent.export([R1]) == [Record("r-a1", {"session": good})]
    waiting = asyncio.create_task(agent.wait_open())
    await asyncio.sleep(0.01)
    assert not waiting.done()  # new activations wait for resume, not refused
    agent.open_admission()
    await asyncio.wait_for(waiting, 1)
    assert await agent.retire([R1]) == ["r-a1"]
    assert agent.session_count() == 0
