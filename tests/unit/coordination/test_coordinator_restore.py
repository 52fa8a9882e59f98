"""Restore all or nothing, with in-process participants (no Ray)."""

from __future__ import annotations

import pytest

from coordination.engine.order import Member
from ray_ckpt.errors import CoordinationFailed, InvalidCheckpointState
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import make_fleet

KEYS = ("environment/env", "model/policy", "agent/agent", "resources/res")


async def _checkpointed() -> tuple[object, str]:
    f = make_fleet()
    for key in KEYS:
        f.parts[key].start("r1", at_boundary=True, state={"at": key})
    await f.core.checkpoint("/ck", [EpisodeId("r1")])
    await f.aclose()
    return f.store, "/ck"


async def test_a_fresh_fleet_restores_under_the_next_attempt() -> None:
    store, d = await _checkpointed()
    f = make_fleet(store=store)  # type: ignore[arg-type]
    try:
        res = await f.core.restore(d, [EpisodeId("r1")])
        assert res.restored == {k: ["r1-a1"] for k in KEYS}
        assert f.parts["agent/agent"].restored == {"r1-a1": {"at": "agent/agent"}}
        assert set(f.phases().values()) == {"idle"}
        assert f.events("resume") == list(reversed(KEYS))
    finally:
        await f.aclose()


async def test_one_failed_restore_discards_what_every_other_installed() -> None:
    store, d = await _checkpointed()
    f = make_fleet(store=store)  # type: ignore[arg-type]
    f.hosts["model/policy"].fail["restore"] = InvalidCheckpointState("digest mismatch")
    try:
        with pytest.raises(CoordinationFailed) as info:
            await f.core.restore(d, [EpisodeId("r1")])
        assert set(info.value.failures) == {"model/policy"}
        assert "digest" in info.value.failures["model/policy"]["detail"]
        for key in KEYS:
            assert f.parts[key].restored == {}, key
        # The next attempt is retired everywhere (callers first), then all resume.
        assert f.events("retire") == [
            "environment/env",
            "agent/agent",
            "model/policy",
            "resources/res",
        ]
        [(_, body)] = [c for c in f.hosts["agent/agent"].calls if c[0] == "retire"]
        assert body["episode_ids"] == [{"rollout_id": "r1", "attempt": 1}]
        assert set(f.phases().values()) == {"idle"}
        assert f.core.open is None
    finally:
        await f.aclose()


async def test_a_participant_the_checkpoint_does_not_list_fails_before_anyone_is_touched() -> None:
    f = make_fleet(listed={("environment", "env"), ("agent", "agent")})
    try:
        with pytest.raises(CoordinationFailed) as info:
            await f.core.restore("/ck", [EpisodeId("r1")])
        assert set(info.value.failures) == {"model/policy", "resources/res"}
        assert f.log == []
    finally:
        await f.aclose()


async def test_retire_right_after_a_restore_uses_the_restore_id() -> None:
    store, d = await _checkpointed()
    f = make_fleet(store=store)  # type: ignore[arg-type]
    try:
        res = await f.core.restore(d, [EpisodeId("r1")], resume=False)
        assert set(f.phases().values()) == {"restored"}
        retired = await f.core.retire([EpisodeId("r1", 1)])
        assert retired.operation_id == res.checkpoint_id
        assert retired.retired[Member("agent", "agent").key] == ["r1-a1"]
        await f.core.resume()
        assert set(f.phases().values()) == {"idle"}
    finally:
        await f.aclose()
