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
    """Each step's status and reply."""
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


# The bare server runs in this process, where warnings are errors: gym_sokoban's
# own rendering calls imageio's deprecated `imread` (the hosted one runs in a
# Ray worker, which does not turn warnings into errors).
@pytest.mark.filterwarnings("ignore:Starting with ImageIO v3:DeprecationWarning")
async def test_steps_past_the_end_answer_as_the_unwrapped_server(real: RealGym) -> None:
    """The wrapper never changes the server's replies: after the terminal step
    Sokoban answers ``terminated`` again from its kept session state (not
    ``400 Session not initialized``); the episode is over for the wrapper
    (no longer live), and the caller's close frees it."""
    from resources_servers.grl_sokoban.app import GrlSokobanResourcesServer

    from participants.nemo_gym.factory import build_server
    from ray_ckpt.gym_server.serving import bind_socket, serve_app, socket_address

    short = {**RESET, "max_steps": 3}  # terminal at the third step
    moves = MOVES[:5]
    live = await real.start(spec("sokoban-end", SERVER), register=False)
    wrapped = [await real.ok(live.at("r", "reset"), short)]
    wrapped += await play(real, live.at, "r", moves)

    bare = build_server(GrlSokobanResourcesServer, name="bare")
    sock = bind_socket("127.0.0.1", 0)
    serving = await serve_app(bare.setup_webserver(), sock, drain_s=0.5)
    host, port = socket_address(sock)
    try:
        # Its own cookie jar: the bare server keys the episode by its cookie session.
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as own:
            url = f"http://{host}:{port}"
            async with own.post(f"{url}/reset", json=short) as resp:
                unwrapped: list[Any] = [await resp.json()]
            for move in moves:
                async with own.post(f"{url}/step", json=step_body(move)) as resp:
                    unwrapped.append((resp.status, await resp.json()))
    finally:
        await serving.stop()
    assert [r[1]["terminated"] for r in unwrapped[1:]] == [False, False, True, True, True]
    assert wrapped == unwrapped
    status = await live.handle.status.remote()
    assert status["report"]["counts"]["sessions"] == 0
    assert status["report"]["counts"]["finished"] == 1
    assert await real.ok(live.at("r", "close_session")) == {"closed": True}
    assert (await real.post(live.at("r", "step"), step_body("Up")))[0] == 400
