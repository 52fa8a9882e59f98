"""The real `workplace_assistant` server (per-session pandas DataFrames inside
tool objects whose bound methods the server calls), unmodified, in a
ParticipantHost: tool calls that change the session's tables, a checkpoint
through the coordinator, a kill -9, a restore into a fresh host, more tool
calls that read those changes: the same outputs as an uninterrupted session."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.nemo_gym.real import RealGym, spec

pytestmark = [pytest.mark.nemo_gym, pytest.mark.ray]

SERVER = "resources_servers.workplace_assistant.app:WorkbenchResourcesServer"
BEFORE: list[tuple[str, dict[str, Any]]] = [
    (
        "calendar_create_event",
        {
            "event_name": "checkpoint review",
            "participant_email": "Luis.Ortiz@atlas.com",
            "event_start": "2023-12-01 10:00:00",
            "duration": "45",
        },
    ),
    ("calendar_delete_event", {"event_id": "00000013"}),
    (
        "email_send_email",
        {"recipient": "luis.ortiz@atlas.com", "subject": "ckpt-subject", "body": "see you"},
    ),
]
AFTER: list[tuple[str, dict[str, Any]]] = [
    ("calendar_search_events", {"query": "checkpoint review"}),
    ("calendar_get_event_information_by_id", {"event_id": "00000013", "field": "event_name"}),
    ("email_search_emails", {"query": "ckpt-subject"}),
    ("email_send_email", {"recipient": "x@atlas.com", "subject": "second", "body": "b"}),
    ("email_search_emails", {"query": "second"}),
]


@pytest.fixture
async def real(namespace: str, tmp_path: Path) -> AsyncIterator[RealGym]:
    async with aiohttp.ClientSession() as http:
        kit = RealGym(namespace, tmp_path, http)
        try:
            yield kit
        finally:
            await kit.close()


async def play(
    real: RealGym, at: Callable[[str, str], str], key: str, calls: list[tuple[str, Any]]
) -> list[Any]:
    return [(await real.ok(at(key, tool), args))["output"] for tool, args in calls]


async def test_workplace_session_continues_after_a_crash(real: RealGym, tmp_path: Path) -> None:
    server = spec(
        "workplace",
        SERVER,
        exported=True,
        field_codecs="tests.nemo_gym.user_codecs:workplace_field_codecs",
    )
    first = await real.start(server)
    await real.ok(first.at("base", "seed_session"))
    base = await play(real, first.at, "base", BEFORE + AFTER)
    # The session's own tables changed (and a fresh session's did not).
    assert "checkpoint review" in str(base[len(BEFORE)])
    assert "ckpt-subject" in str(base[len(BEFORE) + 2])

    await real.ok(first.at("r", "seed_session"))
    assert await play(real, first.at, "r", BEFORE) == base[: len(BEFORE)]
    done = await real.gym.acheckpoint(str(tmp_path / "ck"), ["r"], strict=True)
    assert done.continued == ["r"]
    await real.crash(first)

    second = await real.relaunch(server)
    restored = await real.gym.arestore(str(tmp_path / "ck"), ["r"])
    assert restored.restored == {"resources/workplace": ["r-a1"]}
    assert await play(real, second.at, "r-a1", AFTER) == base[len(BEFORE) :]
    # A session seeded on the new host starts from the server's own data.
    await real.ok(second.at("other", "seed_session"))
    fresh = await play(real, second.at, "other", AFTER[:1])
    assert "checkpoint review" not in str(fresh[0])
