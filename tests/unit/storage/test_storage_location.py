"""A commit or restore into a directory that cannot be used is a typed 4xx.

Real engine, real `FileRecordStore`, real files, over loopback HTTP: the
reply is 400 `invalid_request` naming the directory and the reason (never a
500 from a raw `OSError`), nothing changes, the checkpoint stays open and
resumable, and the next checkpoint into a good directory commits.
"""

from __future__ import annotations

import errno
import os
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from pydantic import SecretStr

from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.control.routes import CHECKPOINT_ROUTE_PREFIX, maybe_install_control_routes
from ray_ckpt.errors import InvalidRequest, ParticipantUnavailable
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage import read_participant
from ray_ckpt.storage.blobstore.location_errors import location_error
from tests.unit.conftest import Serve
from tests.unit.fakes import FakeParticipant

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DEADLINE = 2_000_000_000.0
EPS = [{"rollout_id": "r1", "attempt": 0}]
ROOT = os.geteuid() == 0


def bad_dirs(tmp: pathlib.Path) -> dict[str, str]:
    regular = tmp / "file"
    regular.write_text("not a directory")
    locked = tmp / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    dirs = {
        "under_dev_null": "/dev/null/x",
        "under_a_regular_file": str(regular / "x"),
        "proc_self": "/proc/self/x",
        "proc_no_access": "/proc/1/fdinfo",  # EACCES even for root
        "sys": "/sys/x",
        "nul_byte": str(tmp / "a\0b"),
        "long_component": str(tmp / ("x" * 300)),
    }
    if not ROOT:  # root writes anywhere: these are only unwritable for a user
        dirs["root"] = "/"
        dirs["etc"] = "/etc"
        dirs["read_only_dir"] = str(locked / "ck")
    return dirs


NAMES = [
    "under_dev_null",
    "under_a_regular_file",
    "proc_self",
    "proc_no_access",
    "sys",
    "nul_byte",
    "long_component",
    *([] if ROOT else ["root", "etc", "read_only_dir"]),
]


@pytest.fixture
async def live(
    serve: Serve,
) -> AsyncIterator[tuple[str, ParticipantEngine, FakeParticipant]]:
    participant = FakeParticipant()
    participant.start("r1", at_boundary=True, state={"turn": 3})
    settings = CheckpointSettings(enabled=True, control_auth_token=SecretStr(TOKEN))
    ctl = ParticipantEngine(participant, instance="env-0", settings=settings)
    app = web.Application()
    assert maybe_install_control_routes(app, ctl, settings)
    yield await serve(app), ctl, participant
    await ctl.aclose()


async def post(
    http: aiohttp.ClientSession, base: str, op: str, body: dict[str, Any]
) -> tuple[int, Any]:
    where = f"{base}{CHECKPOINT_ROUTE_PREFIX}/{op}"
    async with http.post(where, json=body, headers=AUTH) as r:
        return r.status, await r.json(content_type=None)


def assert_names_the_directory(reply: Any, directory: str) -> None:
    assert reply["error"]["code"] == "invalid_request", reply
    detail = reply["error"]["detail"]
    assert repr(directory) in detail, detail
    assert "cannot be" in detail or "NUL" in detail, detail


@pytest.mark.parametrize("name", NAMES)
async def test_commit_into_an_unusable_directory_is_400_and_stays_open(
    http: aiohttp.ClientSession,
    live: tuple[str, ParticipantEngine, FakeParticipant],
    tmp_path: pathlib.Path,
    name: str,
) -> None:
    base, ctl, participant = live
    bad = bad_dirs(tmp_path)[name]
    ckpt = {"checkpoint_id": "c1", "deadline_ts": DEADLINE}
    assert (await post(http, base, "prepare", ckpt))[1]["phase"] == "prepared"
    commit = {**ckpt, "checkpoint_dir": bad, "episode_ids": EPS}
    for _ in range(2):  # a retry with the same directory fails the same way
        status, reply = await post(http, base, "commit", commit)
        assert status == 400, reply
        assert_names_the_directory(reply, bad)
        assert ctl.status()["phase"] == "prepared"
        assert not participant.admission_open
    status, reply = await post(http, base, "resume", ckpt)
    assert (status, reply["phase"]) == (200, "idle")
    assert participant.admission_open
    # The next checkpoint, into a usable directory, commits the same records.
    good = tmp_path / "good"
    ckpt2 = {"checkpoint_id": "c2", "deadline_ts": DEADLINE}
    assert (await post(http, base, "prepare", ckpt2))[1]["phase"] == "prepared"
    commit2 = {**ckpt2, "checkpoint_dir": str(good), "episode_ids": EPS}
    status, reply = await post(http, base, "commit", commit2)
    assert (status, reply["episode_ids"]) == (200, ["r1"])
    _, records = read_participant(good, kind="environment", instance="env-0", checkpoint_id="c2")
    assert [(r.key, r.state) for r in records] == [("r1", {"turn": 3})]


# Reachable but absent (or empty): restore's existing "not committed" reply.
NOT_COMMITTED = {"proc_self", "sys", "etc", "root", "read_only_dir"}


@pytest.mark.parametrize("name", NAMES)
async def test_restore_from_an_unusable_directory_is_400_and_changes_nothing(
    http: aiohttp.ClientSession,
    serve: Serve,
    tmp_path: pathlib.Path,
    name: str,
) -> None:
    settings = CheckpointSettings(enabled=True, control_auth_token=SecretStr(TOKEN))
    fresh = FakeParticipant()
    ctl = ParticipantEngine(fresh, instance="env-0", settings=settings)
    app = web.Application()
    assert maybe_install_control_routes(app, ctl, settings)
    base = await serve(app)
    bad = bad_dirs(tmp_path)[name]
    restore = {"checkpoint_id": "c1", "deadline_ts": DEADLINE, "checkpoint_dir": bad}
    status, reply = await post(http, base, "restore", {**restore, "episode_ids": EPS})
    if name in NOT_COMMITTED:
        assert (status, reply["error"]["code"]) == (422, "invalid_checkpoint_state")
        assert "not committed" in reply["error"]["detail"]
    else:
        assert status == 400, reply
        assert_names_the_directory(reply, bad)
    assert ctl.status()["phase"] == "idle"
    assert fresh.admission_open
    assert fresh.fresh()  # still able to take the one restore it may take
    await ctl.aclose()


def test_other_io_failures_are_retryable_unavailable_not_500() -> None:
    full = location_error("/ck", "written", OSError(errno.ENOSPC, "No space left", "/ck/x"))
    assert isinstance(full, ParticipantUnavailable)
    assert full.retryable
    assert "'/ck' cannot be written: No space left (/ck/x)" in full.detail
    denied = location_error("/ck", "read", PermissionError(errno.EACCES, "Permission denied"))
    assert isinstance(denied, InvalidRequest)
    assert not denied.retryable
