"""Rollout IDs up to 1,024 characters (NeMo Gym sets no maximum); a typed 400
beyond the bound; the checkpoint-ID bound stays 128."""

from __future__ import annotations

from typing import Any

import pytest

from ray_ckpt import EpisodeId
from ray_ckpt.control.wire import decode_request
from ray_ckpt.errors import InvalidRequest
from ray_ckpt.identity import MAX_ID_LENGTH, MAX_ROLLOUT_ID_LENGTH, parse_rollout_path

LONG = "r" * 1024


def test_the_bounds() -> None:
    assert MAX_ROLLOUT_ID_LENGTH >= 1024 and MAX_ID_LENGTH == 128


def test_a_1024_character_rollout_id_is_one_episode_everywhere() -> None:
    ep = EpisodeId(LONG, 3)
    assert EpisodeId.from_capture_key(ep.capture_key) == ep
    assert parse_rollout_path(f"/ng-rollout/{ep.capture_key}/step") == (ep, "/step")
    retire = decode_request(
        "retire", {"checkpoint_id": "retire", "deadline_ts": 1.0,
                   "episode_ids": [{"rollout_id": LONG, "attempt": 3}]},
    )  # fmt: skip
    assert retire.episode_ids == [ep]  # type: ignore[attr-defined]
    forget = decode_request(
        "forget", b'{"checkpoint_id":"forget","deadline_ts":1,"rollout_ids":["' + LONG.encode()
        + b'"]}',
    )  # fmt: skip
    assert forget.rollout_ids == [LONG]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "op, body",
    [
        ("retire", {"episode_ids": [{"rollout_id": "r" * (MAX_ROLLOUT_ID_LENGTH + 1)}]}),
        ("forget", {"rollout_ids": ["r" * (MAX_ROLLOUT_ID_LENGTH + 1)]}),
        ("prepare", {"checkpoint_id": "c" * (MAX_ID_LENGTH + 1)}),
    ],
)
def test_beyond_the_bound_is_invalid_request(op: str, body: dict[str, Any]) -> None:
    full = {"checkpoint_id": "c1", "deadline_ts": 1.0, **body}
    with pytest.raises(InvalidRequest) as info:
        decode_request(op, full)
    assert info.value.http_status == 400
    with pytest.raises(InvalidRequest):
        EpisodeId.from_capture_key("r" * (MAX_ROLLOUT_ID_LENGTH + 1))
    with pytest.raises(InvalidRequest):
        EpisodeId("r" * (MAX_ROLLOUT_ID_LENGTH + 1))


async def test_an_episode_with_a_1024_character_rollout_id_runs_and_retires() -> None:
    """Over real HTTP through the four reference participants: the data plane
    (`/ng-rollout/<key>/...` downstream calls), then the retire (its mark
    refuses an older attempt) and forget of that rollout."""
    import time

    import aiohttp

    from participants.fleet import FleetConfig
    from participants.local import start_local_fleet
    from participants.rollout import make_tasks, run_episode

    token = "long-id-token"
    fleet = await start_local_fleet(FleetConfig(token=token, step_delay_s=0.01))
    headers = {"Authorization": f"Bearer {token}"}
    ep = EpisodeId(LONG, 2)

    async def fan(http: aiohttp.ClientSession, op: str, **extra: Any) -> list[dict[str, Any]]:
        body = {"checkpoint_id": f"{op}-1", "deadline_ts": time.time() + 20, **extra}
        out = []
        for url in fleet.urls.values():
            async with http.post(
                f"{url}/ng-control/v1/checkpoint/{op}", json=body, headers=headers
            ) as resp:
                assert resp.status == 200, (op, url, await resp.text())
                out.append(await resp.json())
        return out

    try:
        async with aiohttp.ClientSession() as http:
            task = make_tasks(1, steps=2, seed=3)[0]
            reply = await run_episode(http, fleet.urls["environment"], ep, task)
            assert "result" in reply, reply
            await fan(http, "retire", episode_ids=[{"rollout_id": LONG, "attempt": 2}])
            with pytest.raises(Exception, match="stale_attempt|retired"):
                await run_episode(
                    http, fleet.urls["environment"], EpisodeId(LONG, 1), task, timeout_s=5
                )
            forgotten = await fan(http, "forget", rollout_ids=[LONG])
            assert {tuple(r["forgotten"]) for r in forgotten} == {(LONG,)}
    finally:
        await fleet.stop()
