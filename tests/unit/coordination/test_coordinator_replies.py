"""The coordinator reads any reply shape a participant sends (no Ray).

NeMo Gym's participants send `report.blockers` as capture-key strings, ours
send strings plus `blocker_details`, older ones sent objects; unknown fields
may be there and known ones missing.  Each is read, or fails that
participant with a typed error naming it, and the checkpoint is never left
open.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from coordination.cli.commands import _blocker_cell
from coordination.engine.order import Member
from coordination.engine.status import participant_rows
from coordination.reach.hosts import FakeHost
from ray_ckpt.errors import CoordinationFailed
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import Fleet, make_fleet

AGENT = "agent/agent"
OTHERS = ("environment/env", "model/policy", "resources/res")


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = make_fleet()
    yield f
    await f.aclose()


class ShapedHost(FakeHost):
    """A participant whose prepare and status replies are whatever a test says."""

    def __init__(self, key: str, prepare: Any, status: Any = None) -> None:
        super().__init__(Member.parse(key), reply=self._answer)
        self.prepare_reply = prepare
        self.status_reply = status

    def _answer(self, op: str, body: dict[str, Any]) -> Any:
        if op == "prepare":
            return self.prepare_reply
        if op == "resume":
            return {"phase": "idle", "idempotent": False}
        return {}

    async def status(self) -> Any:
        return self.status_reply


def swap_agent(fleet: Fleet, prepare: Any, status: Any = None) -> ShapedHost:
    host = ShapedHost(AGENT, prepare, status)
    fleet.core.register(host)
    return host


async def failed_prepare(fleet: Fleet) -> CoordinationFailed:
    with pytest.raises(CoordinationFailed) as info:
        await fleet.core.prepare(0.3)
    # Never left open: no open entry, every real participant idle again.
    assert fleet.core.open is None
    assert {fleet.phases()[k] for k in OTHERS} == {"idle"}
    return info.value


@pytest.mark.parametrize(
    ("report", "keys", "count", "details"),
    [
        # NeMo Gym's shape: strings, the full count beside them.
        ({"ready": False, "blockers": ["r1", "r2-a1"], "blocker_count": 150}, ["r1", "r2-a1"], 150,
         None),
        # Ours now: strings plus per-blocker objects under blocker_details.
        ({"blockers": ["r1"], "blocker_count": 1,
          "blocker_details": [{"key": "r1", "state": "wait_step", "step": "verify"}]},
         ["r1"], 1, [{"key": "r1", "state": "wait_step", "step": "verify"}]),
        # Older participants of ours: objects in blockers.
        ({"blockers": [{"key": "r3", "state": "running", "extra": 1}]}, ["r3"], 1,
         [{"key": "r3", "state": "running", "extra": 1}]),
        # Nothing usable at all: still typed.
        ({"blockers": "r1", "blocker_count": "many", "unknown": {}}, [], 0, None),
    ],
)  # fmt: skip
async def test_a_not_prepared_reply_with_any_blocker_shape_fails_typed_and_resumes_everyone(
    fleet: Fleet,
    report: dict[str, Any],
    keys: list[str],
    count: int,
    details: list[dict[str, Any]] | None,
) -> None:
    agent = swap_agent(fleet, {"phase": "preparing", "report": report, "new_field": 1})
    failed = await failed_prepare(fleet)
    entry = failed.failures[AGENT]
    assert entry["code"] == "deadline_exceeded"
    assert entry["blockers"] == keys
    assert entry["blocker_count"] == count
    assert entry.get("blocker_details") == details
    assert [op for op, _ in agent.calls] == ["prepare", "resume"]


@pytest.mark.parametrize(
    "reply",
    [
        ["not", "an", "object"],
        "prepared",
        None,
        {"report": ["x"]},  # no phase, report not an object
        {"phase": "prepared", "report": {"restarts": "r1"}},  # restarts not a list: ignored
    ],
)
async def test_a_malformed_prepare_reply_fails_that_participant_by_name(
    fleet: Fleet, reply: Any
) -> None:
    swap_agent(fleet, reply)
    if isinstance(reply, dict) and reply.get("phase") == "prepared":
        prepared = await fleet.core.prepare(0.3)
        assert prepared.restarts == {}
        await fleet.core.resume()
        assert set(fleet.phases().values()) == {"idle"}
        return
    failed = await failed_prepare(fleet)
    assert set(failed.failures) == {AGENT}
    assert AGENT in str(failed)


async def test_commit_and_restore_replies_missing_fields_are_read_as_empty(fleet: Fleet) -> None:
    def answer(op: str, body: dict[str, Any]) -> Any:
        if op == "prepare":
            return {"phase": "prepared"}  # no report at all
        if op == "commit":
            return {"phase": "committed", "manifest": "not-an-object", "episode_ids": None}
        if op == "restore":
            return {"phase": "restored", "restored": [1, "r0-a1"]}
        return {}

    fleet.core.register(FakeHost(Member.parse(AGENT), reply=answer))
    fleet.parts["environment/env"].start("r0", at_boundary=True, state={})
    result = await fleet.core.checkpoint("/ck", [EpisodeId("r0")])
    assert result.episode_ids[AGENT] == []
    assert result.bytes[AGENT] == 0
    assert result.episode_ids["environment/env"] == ["r0"]


def row_status(report: Any, **extra: Any) -> dict[str, Any]:
    return {"kind": "agent", "instance": "agent", "phase": "preparing", "report": report, **extra}


@pytest.mark.parametrize(
    ("status", "keys", "count", "cell"),
    [
        (row_status({"blockers": ["r1", "r2-a1"], "blocker_count": 7}), ["r1", "r2-a1"], 7,
         ["r1", "r2-a1"]),
        (row_status({"blockers": ["r1"], "blocker_count": 1,
                     "blocker_details": [{"key": "r1", "state": "wait_step", "step": "verify"}]}),
         ["r1"], 1, ["r1 (wait_step verify)"]),
        (row_status({"blockers": [{"key": "r3", "state": "running"}]}), ["r3"], 1,
         ["r3 (running)"]),
        (row_status(None, lease_expires_at="soon", live_executions=[], checkpoint_id=3), [], 0,
         []),
        ("not an object", [], 0, []),
    ],
)  # fmt: skip
async def test_status_rows_and_the_cli_table_read_every_blocker_shape(
    status: Any, keys: list[str], count: int, cell: list[str]
) -> None:
    host = ShapedHost(AGENT, None, status)
    [row] = await participant_rows([host], 1.0)
    assert row.error is None
    assert row.blockers == keys
    assert row.blocker_count == count
    assert _blocker_cell(row) == cell
    if not isinstance(status, dict) or status.get("report") is None:
        assert row.lease_expires_at is None
        assert row.live_executions is None
        assert row.checkpoint_id is None
