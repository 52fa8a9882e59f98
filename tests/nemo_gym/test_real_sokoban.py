"""The real `grl_sokoban` server (a `GymnasiumServer`: numpy room arrays, a
dict keyed by tuples of numpy ints, a dataclass session state), unmodified, in
a ParticipantHost: part of a seeded episode, a checkpoint through the
coordinator, a kill -9, a restore into a fresh host, the rest of the episode:
the same boards, rewards and ending as an uninterrupted episode."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from ray_ckpt.errors import CoordinationFailed
from tests.nemo_gym.real import CREATE_PARAMS, RealGym, response, spec

pytestmark = [pytest.mark.nemo_gym, pytest.mark.ray]

SERVER = "resources_servers.grl_sokoban.app:GrlSokobanResourcesServer"
# The room comes from the seed in the reset's metadata: the server's own seeding.
RESET = {"responses_create_params": CREATE_PARAMS, "seed": 4}
MOVES = ["Down", "Down", "Up", "Right", "Left", "Left", "Down", "Down", "Up", "Right"]
CUT = 4


@pytest.fixture
async def real(namespace: str, tmp_path: Path) -> AsyncIterator[RealGym]:
    async with aiohttp.ClientSession() as http:
        kit = RealGym(namespace, tmp_path, http)
        try:
            yield kit
        finally:
            await kit.close()


def step_body(move: str) -> dict[str, Any]:
    action = response(f"<action>{move}</action>")
    return {"responses_create_params": CREATE_PARAMS, "response": action}


async def play(
    real: RealGym, at: Callable[[str, str], str], key: str, moves: list[str]
) -> list[tuple[int, Any]]:
    """Each step's status and reply (a finished episode answers 400 from then on)."""
    return [await real.post(at(key, "step"), step_body(m)) for m in moves]


async def test_sokoban_episode_continues_after_a_crash(real: RealGym, tmp_path: Path) -> None:
    server = spec(
        "sokoban", SERVER, exported=True, codecs="tests.nemo_gym.user_codecs:sokoban_codecs"
    )
    first = await real.start(server)
    base_reset = await real.ok(first.at("base", "reset"), RESET)
    base = await play(real, first.at, "base", MOVES)

    reset = await real.http.post(first.at("r", "reset"), json=RESET)
    assert reset.status == 200
    assert "x-ng-checkpoint-restart" not in reset.headers
    assert await reset.json() == base_reset
    before = await play(real, first.at, "r", MOVES[:CUT])
    assert before == base[:CUT]
    assert not any(reply.get("terminated") for _, reply in before)  # cut mid-episode

    done = await real.gym.acheckpoint(str(tmp_path / "ck"), ["r"], strict=True)
    assert done.continued == ["r"]
    await real.crash(first)

    second = await real.relaunch(server)
    restored = await real.gym.arestore(str(tmp_path / "ck"), ["r"])
    assert restored.restored == {"resources/sokoban": ["r-a1"]}
    after = await play(real, second.at, "r-a1", MOVES[CUT:])
    assert after == base[CUT:]


async def test_without_a_codec_the_commit_names_the_unknown_type(
    real: RealGym, tmp_path: Path
) -> None:
    live = await real.start(spec("sokoban-nocodec", SERVER, exported=True))
    await real.ok(live.at("r", "reset"), RESET)
    with pytest.raises(CoordinationFailed) as caught:
        await real.gym.acheckpoint(str(tmp_path / "ck"), ["r"])
    detail = str(caught.value.failures)
    assert "invalid_checkpoint_state" in detail
    assert (
        "episode r: state.session_id_to_state.env is "
        "resources_servers.grl_sokoban.sokoban_env.sokoban_env.SokobanEnv: register a codec"
    ) in detail
    # The failed commit changed nothing: the episode plays on.
    assert (await real.post(live.at("r", "step"), step_body("Up")))[0] == 200
