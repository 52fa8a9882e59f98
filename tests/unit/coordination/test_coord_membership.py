"""Membership: frozen when a checkpoint opens, dead members dropped (no Ray)."""

from __future__ import annotations

import json
import pathlib

import pytest

from ray_ckpt.errors import CoordinationFailed
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import DEFAULT_MEMBERS, make_fleet

AGENT = "agent/agent"
LATE = "agent/late"


async def test_a_host_registered_while_a_checkpoint_is_open_joins_the_next_one(
    tmp_path: pathlib.Path,
) -> None:
    f = make_fleet(state_dir=str(tmp_path))
    journal = tmp_path / "coordinator-state.json"
    try:
        f.parts["environment/env"].start("r1", at_boundary=True, state={"s": 1})
        prepared = await f.core.prepare()
        f.add(LATE)  # e.g. discovered by a status() call meanwhile
        status = await f.core.status()
        assert status.open_checkpoint == prepared.checkpoint_id
        assert LATE in {r.participant for r in status.participants}
        committed = await f.core.commit("/ck", [EpisodeId("r1")])
        assert committed.checkpoint_id == prepared.checkpoint_id
        # The journal names the members the checkpoint was prepared with.
        assert set(json.loads(journal.read_text())["members"]) == set(DEFAULT_MEMBERS)
        await f.core.resume()
        for op in ("prepare", "commit", "resume"):
            assert LATE not in f.events(op), op
        assert sorted(m["instance"] for m in f.manifests[0][2]) == sorted(
            k.split("/")[1] for k in DEFAULT_MEMBERS
        )
        assert f.phases()[LATE] == "idle"

        # The next checkpoint has it.
        f.log.clear()
        await f.core.checkpoint("/ck2")
        assert LATE in f.events("prepare")
        assert LATE in f.events("commit")
        assert LATE in f.events("resume")
    finally:
        await f.aclose()


async def test_a_member_unregistered_while_open_is_still_resumed_by_that_checkpoint() -> None:
    f = make_fleet()
    try:
        await f.core.prepare()
        f.core.unregister(AGENT)
        await f.core.resume()
        assert AGENT in f.events("resume")
        assert f.phases()[AGENT] == "idle"
        # Gone from the next one.
        f.log.clear()
        await f.core.checkpoint("/ck")
        assert AGENT not in f.events("prepare")
    finally:
        await f.aclose()


async def test_a_dead_member_fails_its_prepare_by_name_and_is_gone_from_the_next() -> None:
    f = make_fleet()
    try:
        f.hosts[AGENT].dead = True
        with pytest.raises(CoordinationFailed) as info:
            await f.core.prepare()
        assert set(info.value.failures) == {AGENT}
        assert info.value.failures[AGENT]["code"] == "participant_unavailable"
        assert AGENT in str(info.value)
        assert AGENT not in f.core.hosts
        assert f.core.open is None

        f.log.clear()
        result = await f.core.checkpoint("/ck")
        assert AGENT not in f.events("prepare")
        assert set(result.timings) == set(DEFAULT_MEMBERS) - {AGENT}
    finally:
        await f.aclose()


async def test_a_replacement_registered_under_a_dead_members_name_stays() -> None:
    f = make_fleet()
    try:
        await f.core.prepare()
        f.hosts[AGENT].dead = True
        replacement = f.add(AGENT)  # a fresh actor under the same name
        failures = (await f.core.resume()).failures
        assert set(failures) == {AGENT}, "the open checkpoint still called the dead one"
        assert f.core.hosts[AGENT] is replacement
    finally:
        await f.aclose()


async def test_recovery_aborts_with_the_journalled_members_only(tmp_path: pathlib.Path) -> None:
    from coordination.engine.coordinator_core import CoordinatorCore
    from coordination.engine.journal import Journal
    from tests.unit.coordination.coord_fleet import FAST

    old = make_fleet(state_dir=str(tmp_path))
    try:
        prepared = await old.core.prepare()
        newcomer = old.add(LATE, register=False)
        # A new coordinator over the same state finds the old members and one more.
        new = CoordinatorCore(journal=Journal(str(tmp_path)), timeouts=FAST)
        for key in (*DEFAULT_MEMBERS, LATE):
            new.register(old.hosts[key])
        old.log.clear()
        assert await new.recover() == prepared.checkpoint_id
        assert sorted(old.events("resume")) == sorted(DEFAULT_MEMBERS)
        assert newcomer.calls == []
        assert set(old.phases().values()) == {"idle"}
    finally:
        await old.aclose()
