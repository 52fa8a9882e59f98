"""The control token never leaves the auth header: a checkpoint, a status, a
refused call and a failed checkpoint over real HTTP servers, and the token is
in no log line (any logger, DEBUG up), no status, no journal and no error text."""

from __future__ import annotations

import json
import logging
import pathlib
import uuid

import msgspec
import pytest

from coordination.engine.coordinator_core import CoordinatorCore
from coordination.engine.journal import Journal
from coordination.engine.order import Member
from coordination.reach.hosts import HttpHost
from participants.fleet import FleetConfig
from participants.local import start_local_fleet
from ray_ckpt.control.client import ControlClient
from ray_ckpt.errors import CheckpointError
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import FAST

TOKEN = f"tok-{uuid.uuid4().hex}"


def files_under(root: pathlib.Path) -> list[str]:
    return [p.read_text(errors="replace") for p in root.rglob("*") if p.is_file()]


async def test_the_token_appears_in_no_log_status_journal_or_error(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    state = tmp_path / "state"
    config = FleetConfig(token=TOKEN)
    fleet = await start_local_fleet(config)
    core = CoordinatorCore(journal=Journal(str(state)), timeouts=FAST)
    texts: list[str] = []
    journal_write = core.journal.write

    def keep_journal(data: bytes) -> None:  # the journal as written, each time
        texts.append(data.decode())
        journal_write(data)

    core.journal.write = keep_journal  # type: ignore[method-assign]
    try:
        for kind, url in fleet.urls.items():
            name = config.server_name(kind)
            core.register(
                HttpHost(
                    Member(kind, name), ControlClient(url, token=TOKEN, limit=4, limit_per_host=4)
                )
            )
        result = await core.checkpoint(str(tmp_path / "ck"), [EpisodeId("r1")])
        texts.append(msgspec.json.encode(result).decode())
        texts.append(msgspec.json.encode(await core.status()).decode())
        # A call with a wrong token is refused; its error names no token.
        wrong = ControlClient(fleet.urls["agent"], token=TOKEN[::-1], limit=1, limit_per_host=1)
        try:
            with pytest.raises(CheckpointError) as refused:
                await wrong.call("prepare", {"checkpoint_id": "x", "deadline_ts": 1e10})
            texts.append(str(refused.value))
            texts.append(repr(refused.value))
        finally:
            await wrong.aclose()
        # A checkpoint that fails (a server gone): its error and its logs.
        await fleet.servers["resources"].stop()
        with pytest.raises(CheckpointError) as failed:
            await core.checkpoint(str(tmp_path / "ck2"), [EpisodeId("r1")])
        texts.append(str(failed.value))
        texts.append(json.dumps(getattr(failed.value, "failures", {}), default=str))
    finally:
        await core.aclose()
        await fleet.stop()
    texts.extend(record.getMessage() for record in caplog.records)
    texts.extend(str(record.exc_info) for record in caplog.records if record.exc_info)
    texts.extend(files_under(tmp_path))  # checkpoint and journal files, as left on disk
    assert any("prepare" in t for t in texts)  # the logs were captured at all
    assert [t for t in texts if TOKEN in t] == []
