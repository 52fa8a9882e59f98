"""Restore membership both ways, resume failures, continued/restart and strict (no Ray)."""

from __future__ import annotations

import pathlib

import pytest

from ray_ckpt.errors import (
    CoordinationFailed,
    InvalidRequest,
    ParticipantUnavailable,
    RestartInScope,
)
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import DEFAULT_MEMBERS, Fleet, make_fleet
from tests.unit.fakes import MemoryStore

ENV, AGENT, RES = "environment/env", "agent/agent", "resources/res"
ALL = {tuple(k.split("/")) for k in DEFAULT_MEMBERS}


def pair(key: str) -> tuple[str, str]:
    kind, name = key.split("/")
    return kind, name


async def _checkpointed(*keys: str) -> MemoryStore:
    """A checkpoint of every default member holding state for `keys`."""
    f = make_fleet()
    for member in DEFAULT_MEMBERS:
        for key in keys:
            f.parts[member].start(key, at_boundary=True, state={"at": member})
    await f.core.checkpoint("/ck", [EpisodeId.from_capture_key(k) for k in keys])
    await f.aclose()
    return f.store


def untouched(f: Fleet) -> None:
    assert f.log == [], "no participant was called"
    assert set(f.phases().values()) == {"idle"}
    assert f.core.open is None


# --- restore membership ----------------------------------------------------------


async def test_a_listed_participant_that_is_not_registered_fails_the_whole_restore() -> None:
    f = make_fleet(listed=ALL | {("resources", "res2")})
    try:
        with pytest.raises(CoordinationFailed) as info:
            await f.core.restore("/ck", [EpisodeId("r1")])
        assert info.value.operation == "restore"
        assert set(info.value.failures) == {"resources/res2"}
        why = info.value.failures["resources/res2"]
        assert why["code"] == "invalid_checkpoint_state"
        assert "listed" in why["detail"]
        assert "not registered" in why["detail"]
        assert "resources/res2" in str(info.value)
        untouched(f)
    finally:
        await f.aclose()


async def test_restore_membership_is_checked_both_ways_at_once() -> None:
    # The checkpoint had env, agent and a resources server `other`; here the
    # registered fleet is the default one.
    f = make_fleet(listed={pair(ENV), pair(AGENT), ("resources", "other")})
    try:
        with pytest.raises(CoordinationFailed) as info:
            await f.core.restore("/ck", [EpisodeId("r1")])
        unlisted = set(DEFAULT_MEMBERS) - {ENV, AGENT}
        assert set(info.value.failures) == unlisted | {"resources/other"}
        for key in unlisted:
            assert "not listed" in info.value.failures[key]["detail"]
        assert "not registered" in info.value.failures["resources/other"]["detail"]
        untouched(f)
    finally:
        await f.aclose()


# --- restore results ---------------------------------------------------------------


async def test_restore_reports_resume_failures() -> None:
    store = await _checkpointed("r1")
    f = make_fleet(store=store)
    f.hosts[AGENT].fail["resume"] = ParticipantUnavailable("agent went away")
    try:
        res = await f.core.restore("/ck", [EpisodeId("r1")])
        assert set(res.resume_failures) == {AGENT}
        assert res.resume_failures[AGENT]["code"] == "participant_unavailable"
        assert "went away" in res.resume_failures[AGENT]["detail"]
        assert res.restored[ENV] == ["r1-a1"]
    finally:
        await f.aclose()


async def test_restore_says_which_episodes_continue_and_which_start_over() -> None:
    store = await _checkpointed("r1", "r2-a3")
    f = make_fleet(store=store)
    try:
        res = await f.core.restore("/ck", [EpisodeId("r1"), EpisodeId("r2", 3), EpisodeId("r9")])
        assert res.continued == ["r1", "r2-a3"]
        assert res.restart == ["r9"]
        assert res.resume_failures == {}
    finally:
        await f.aclose()


# --- commit results and strict ------------------------------------------------------


async def test_commit_says_per_episode_of_the_scope_whether_it_continues() -> None:
    f = make_fleet()
    try:
        f.parts[ENV].start("r1", at_boundary=True, state={"s": 1})
        f.parts[AGENT].start("r2", at_boundary=True, state={"s": 2})
        await f.core.prepare()
        scope = [EpisodeId("r1"), EpisodeId("r2"), EpisodeId("r3")]
        committed = await f.core.commit("/ck", scope)
        assert committed.continued == ["r1", "r2"]
        assert committed.restart == ["r3"]
        await f.core.resume()
        result = await f.core.checkpoint("/ck2", scope)
        assert (result.continued, result.restart) == (["r1", "r2"], ["r3"])
    finally:
        await f.aclose()


async def test_without_a_scope_restart_only_episodes_are_the_restarts() -> None:
    f = make_fleet()
    try:
        f.parts[ENV].start("r1", at_boundary=True, state={"s": 1})
        f.parts[ENV].start("r2")  # mid-step, restart-only: never exported
        f.parts[ENV].restarts.add("r2")
        result = await f.core.checkpoint("/ck")
        assert (result.continued, result.restart) == (["r1"], ["r2"])
        with pytest.raises(RestartInScope):
            await f.core.checkpoint("/ck2", strict=True)
    finally:
        await f.aclose()


async def test_strict_refuses_a_commit_where_an_episode_has_no_state_anywhere(
    tmp_path: pathlib.Path,
) -> None:
    f = make_fleet(state_dir=str(tmp_path))
    try:
        f.parts[ENV].start("r1", at_boundary=True, state={"s": 1})
        scope = [EpisodeId("r1"), EpisodeId("r3")]
        with pytest.raises(RestartInScope) as info:
            await f.core.checkpoint("/ck", scope, strict=True)
        assert "r3" in str(info.value)
        assert "'r1'" not in str(info.value)
        assert f.manifests == [], "no Gym manifest is published"
        assert set(f.phases().values()) == {"idle"}
        assert f.core.open is None
        await f.core.settle_journal()  # the close's clear runs after the reply
        assert not (tmp_path / "coordinator-state.json").exists()
        # Split calls: the same refusal, then the fleet takes the next checkpoint.
        await f.core.prepare()
        with pytest.raises(RestartInScope):
            await f.core.commit("/ck", scope, strict=True)
        assert f.core.open is None
        assert f.manifests == []
        ok = await f.core.checkpoint("/ck", [EpisodeId("r1")], strict=True)
        assert ok.continued == ["r1"]
        assert ok.restart == []
        assert len(f.manifests) == 1
    finally:
        await f.aclose()


async def test_strict_with_stop_is_refused_before_anything_is_touched() -> None:
    f = make_fleet()
    try:
        await f.core.prepare()
        f.log.clear()
        with pytest.raises(InvalidRequest):
            await f.core.commit("/ck", [EpisodeId("r1")], stop=True, strict=True)
        assert f.log == []
        assert set(f.phases().values()) == {"prepared"}, "the open checkpoint is untouched"
        await f.core.resume()
    finally:
        await f.aclose()
