"""A checkpoint without a scope takes the assembler's in-flight episodes (no Ray)."""

from __future__ import annotations

import pytest

from coordination.reach.hosts import FakePauseTarget
from ray_ckpt.errors import CoordinationFailed, InvalidRequest
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import DEFAULT_MEMBERS, make_fleet


async def test_the_scope_is_asked_after_prepare_while_the_assembler_is_paused() -> None:
    f = make_fleet()
    assembler = FakePauseTarget("assembler", log=f.log)
    f.core.register_pause(assembler)
    for member in DEFAULT_MEMBERS:
        for key in ("r1", "r2"):
            f.parts[member].start(key, at_boundary=True, state={"at": member})
    asked: list[tuple[str | None, list[str]]] = []

    async def in_flight() -> list[EpisodeId]:
        asked.append((assembler.paused, sorted(f.phases().values())))
        return [EpisodeId("r1"), EpisodeId("gone")]

    try:
        result = await f.core.checkpoint("/ck", scope_source=in_flight)
        assert len(asked) == 1
        paused, phases = asked[0]
        assert paused == result.checkpoint_id, "asked while the assembler is paused"
        assert set(phases) == {"prepared"}, "asked after every participant prepared"
        assert result.continued == ["r1"]
        assert result.restart == ["gone"]
        assert all(keys == ["r1"] for keys in result.episode_ids.values())
        # A scope given by the caller wins: the source is not asked.
        await f.core.checkpoint("/ck2", [EpisodeId("r2")], scope_source=in_flight)
        assert len(asked) == 1
    finally:
        await f.aclose()


async def test_a_failing_scope_source_aborts_and_names_the_assembler() -> None:
    f = make_fleet()
    for member in DEFAULT_MEMBERS:
        f.parts[member].start("r1", at_boundary=True, state={})

    async def broken() -> list[EpisodeId]:
        raise InvalidRequest("not an episode: 7")

    try:
        with pytest.raises(CoordinationFailed) as info:
            await f.core.checkpoint("/ck", scope_source=broken)
        assert set(info.value.failures) == {"assembler"}
        assert info.value.failures["assembler"]["code"] == "invalid_request"
        assert f.core.open is None
        assert set(f.phases().values()) == {"idle"}, "everyone resumed"
        assert f.manifests == [], "nothing committed"
    finally:
        await f.aclose()
