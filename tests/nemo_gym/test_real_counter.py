"""The real `example_session_state_mgmt` server (NeMo Gym 0.4.0), unmodified, in a
ParticipantHost: part of an episode, a checkpoint through the coordinator, a
kill -9 of the host, a restore into a fresh host, the rest of the episode —
the same counter and reward as an uninterrupted episode."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from ray_ckpt.errors import CoordinationFailed, RestartInScope
from tests.nemo_gym.real import CREATE_PARAMS, RealGym, response, spec

pytestmark = [pytest.mark.nemo_gym, pytest.mark.ray]

SERVER = "resources_servers.example_session_state_mgmt.app:StatefulCounterResourcesServer"
STEPS = [1, 2, 3, 4, 5]
CUT = 2  # increments done before the checkpoint


@pytest.fixture
async def real(namespace: str, tmp_path: Path) -> AsyncIterator[RealGym]:
    async with aiohttp.ClientSession() as http:
        kit = RealGym(namespace, tmp_path, http)
        try:
            yield kit
        finally:
            await kit.close()


async def play(
    real: RealGym, at: Callable[[str, str], str], key: str, steps: list[int]
) -> list[int]:
    counts = []
    for step in steps:
        assert await real.ok(at(key, "increment_counter"), {"count": step}) == {"success": True}
        counts.append((await real.ok(at(key, "get_counter_value")))["count"])
    return counts


def verify_body(expected: int) -> dict[str, object]:
    return {
        "responses_create_params": CREATE_PARAMS,
        "response": response("done"),
        "expected_count": expected,
    }


async def test_counter_episode_continues_after_a_crash(real: RealGym, tmp_path: Path) -> None:
    server = spec("counter", SERVER, exported=True)
    first = await real.start(server)

    # The uninterrupted episode, seeded the same way.
    await real.ok(first.at("base", "seed_session"), {"initial_count": 10})
    base_counts = await play(real, first.at, "base", STEPS)
    base_verify = await real.ok(first.at("base", "verify"), verify_body(25))
    assert base_counts == [11, 13, 16, 20, 25]
    assert base_verify["reward"] == 1.0

    seeded = await real.http.post(first.at("r", "seed_session"), json={"initial_count": 10})
    assert seeded.status == 200
    assert seeded.headers["x-ng-checkpoint-verify"] == "wait"
    assert "x-ng-checkpoint-restart" not in seeded.headers
    before = await play(real, first.at, "r", STEPS[:CUT])

    done = await real.gym.acheckpoint(str(tmp_path / "ck"), ["r"], strict=True)
    assert done.continued == ["r"]
    assert done.episode_ids == {"resources/counter": ["r"]}
    await real.crash(first)

    second = await real.relaunch(server)
    assert second.info["pid"] != first.info["pid"]
    restored = await real.gym.arestore(str(tmp_path / "ck"), ["r"])
    assert restored.restored == {"resources/counter": ["r-a1"]}
    after = await play(real, second.at, "r-a1", STEPS[CUT:])
    assert before + after == base_counts
    assert await real.ok(second.at("r-a1", "verify"), verify_body(25)) == base_verify
    # The checkpointed attempt is superseded on the new host.
    status, err = await real.post(second.at("r", "get_counter_value"))
    assert (status, err["error"]["code"]) == (409, "stale_attempt")


async def test_restart_only_by_default(real: RealGym, tmp_path: Path) -> None:
    live = await real.start(spec("counter-ro", SERVER))
    seeded = await real.http.post(live.at("r", "seed_session"), json={"initial_count": 1})
    assert seeded.headers["x-ng-checkpoint-restart"] == "1"
    # Nothing to continue: the participant lists the session as a restart...
    done = await real.gym.acheckpoint(str(tmp_path / "ck"))
    assert done.restarts == {"resources/counter-ro": ["r"]}
    assert done.episode_ids == {"resources/counter-ro": []}
    # ...and refuses (typed) to put it in a checkpoint's scope.
    with pytest.raises(CoordinationFailed, match="restart_in_scope"):
        await real.gym.acheckpoint(str(tmp_path / "ck2"), ["r"])
    # Strict: the same cause as an episode no participant holds, the same typed error.
    with pytest.raises(RestartInScope, match="'r'"):
        await real.gym.acheckpoint(str(tmp_path / "ck3"), ["r"], strict=True)
