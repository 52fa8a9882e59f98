"""The asynchronous commit on one engine, over real files: pending once
captured, resume while the write runs, a re-sent commit answering the final
manifest or the write's error, the next prepare waiting for the write, and a
capture that later changes of the live state cannot reach."""

from __future__ import annotations

import asyncio
import pathlib
import threading
from typing import Any

import pytest

from ray_ckpt.clock import SystemClock
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import (
    CheckpointConflict,
    DeadlineExceeded,
    InvalidCheckpointState,
    InvalidRequest,
)
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage import read_participant
from ray_ckpt.storage.seam import FileRecordStore
from tests.unit.fakes import FakeParticipant
from tests.unit.helpers import body


class GatedStore(FileRecordStore):
    """Real files; each write waits for the gate (a slow disk), or fails."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.started = threading.Event()
        self.fail: Exception | None = None

    def write(self, checkpoint_dir: str, **kw: Any) -> Any:
        self.started.set()
        self.gate.wait(10)
        if self.fail is not None:
            raise self.fail
        return super().write(checkpoint_dir, **kw)


def make() -> tuple[ParticipantEngine, FakeParticipant, GatedStore]:
    p = FakeParticipant()
    store = GatedStore()
    settings = CheckpointSettings(enabled=True, control_auth_token="t", lease_grace_seconds=60)
    c = ParticipantEngine(
        p, instance="env0", settings=settings, clock=SystemClock(), store=store
    )
    return c, p, store


async def started(store: GatedStore) -> None:
    await asyncio.to_thread(store.started.wait, 5)


async def test_pending_then_resume_while_writing_then_the_final_manifest(
    tmp_path: pathlib.Path,
) -> None:
    c, p, store = make()
    state = {"tokens": [1, 2, 3], "text": "x" * 1000}
    p.start("r1", at_boundary=True, state=state)
    await c.handle("prepare", body("c1"))
    ck = str(tmp_path / "ck")
    reply = await c.handle("commit", body("c1", checkpoint_dir=ck, durability="async"))
    assert reply["phase"] == "committed"
    assert reply["pending"] is True
    assert reply["episode_ids"] == ["r1"]
    # The copy is measured by the write, after the resume: unknown, not 0.
    assert reply["captured_bytes"] is None
    st = c.status()
    assert st["writes_in_flight"] == 1
    assert st["background_write"] == {"checkpoint_id": "c1", "captured_bytes": None}
    # The write waits for the resume (the other participants may still be
    # capturing under the same pause) ...
    assert not store.started.is_set()
    # ... and runs on after it: admission reopens, the write goes on.
    await c.handle("resume", body("c1"))
    assert p.admission_open
    assert c.status()["phase"] == "idle"
    await started(store)
    assert c.status()["writes_in_flight"] == 1
    # Measured as the write reads the copies: not before (the gate holds it).
    assert c.status()["background_write"]["captured_bytes"] is None
    # The live state changes after the capture ...
    state["tokens"].append(4)
    state["text"] = "changed"
    # ... a re-sent commit that gives up early does not stop the write ...
    with pytest.raises(DeadlineExceeded):
        await c.handle("commit", body("c1", deadline=0.2, checkpoint_dir=ck, durability="async"))
    store.gate.set()
    final = await c.handle("commit", body("c1", checkpoint_dir=ck, durability="async"))
    assert final["phase"] == "committed"
    assert "pending" not in final
    assert final["manifest"]["record_count"] == 1
    # The copy's own containers: the 1,000-character leaf is shared, not copied.
    assert 0 < final["captured_bytes"] < 1000
    assert [s["name"] for s in final["spans"]] == ["capture", "write"]
    assert c.status()["writes_in_flight"] == 0
    assert c.status()["background_write"] is None
    # ... and not a byte of what was written changed with it.
    _, records = read_participant(ck, kind=p.kind, instance="env0", checkpoint_id="c1")
    assert [(r.key, r.state) for r in records] == [
        ("r1", {"tokens": [1, 2, 3], "text": "x" * 1000})
    ]
    await c.aclose()


async def test_the_next_prepare_waits_for_the_write_and_names_it(tmp_path: pathlib.Path) -> None:
    c, p, store = make()
    p.start("r1", at_boundary=True, state={"a": 1})
    await c.handle("prepare", body("c1"))
    await c.handle("commit", body("c1", checkpoint_dir=str(tmp_path / "a"), durability="async"))
    await c.handle("resume", body("c1"))
    await started(store)
    waiting = await c.handle("prepare", body("c2", deadline=0.3))
    assert waiting["phase"] == "preparing"
    assert waiting["report"]["ready"] is False
    assert waiting["report"]["blockers"][0] == "write-in-flight:c1"
    assert not p.admission_open  # closed, as any prepare that waits
    store.gate.set()
    ready = await c.handle("prepare", body("c2"))
    assert ready["phase"] == "prepared"
    # The second checkpoint's capture runs only after the first write ended.
    second = await c.handle(
        "commit", body("c2", checkpoint_dir=str(tmp_path / "b"), durability="async")
    )
    assert second["pending"] is True
    final = await c.handle("commit", body("c2", checkpoint_dir=str(tmp_path / "b")))
    assert final["manifest"]["record_count"] == 1
    await c.handle("resume", body("c2"))
    await c.aclose()


async def test_a_failed_write_is_the_re_sent_commits_typed_error_and_publishes_nothing(
    tmp_path: pathlib.Path,
) -> None:
    c, p, store = make()
    p.start("r1", at_boundary=True, state={"a": 1})
    await c.handle("prepare", body("c1"))
    ck = tmp_path / "ck"
    await c.handle("commit", body("c1", checkpoint_dir=str(ck), durability="async"))
    await c.handle("resume", body("c1"))
    store.fail = InvalidCheckpointState("records write failed: EIO (test)")
    store.gate.set()
    with pytest.raises(InvalidCheckpointState, match="EIO"):
        await c.handle("commit", body("c1", checkpoint_dir=str(ck), durability="async"))
    assert not list(ck.rglob("manifest.json"))
    # The next checkpoint is not held up by the failed one.
    store.fail = None
    assert (await c.handle("prepare", body("c2")))["phase"] == "prepared"
    await c.aclose()


async def test_a_host_that_stops_mid_write_publishes_nothing(tmp_path: pathlib.Path) -> None:
    c, p, store = make()
    p.start("r1", at_boundary=True, state={"a": 1})
    await c.handle("prepare", body("c1"))
    ck = tmp_path / "ck"
    await c.handle("commit", body("c1", checkpoint_dir=str(ck), durability="async"))
    await c.handle("resume", body("c1"))
    await started(store)
    closing = asyncio.create_task(c.aclose())
    await asyncio.sleep(0.05)
    store.gate.set()
    await closing
    assert not list(ck.rglob("manifest.json"))


async def test_bad_async_requests_change_nothing(tmp_path: pathlib.Path) -> None:
    c, p, _ = make()
    p.start("r1", at_boundary=True, state={"a": 1})
    await c.handle("prepare", body("c1"))
    ck = str(tmp_path / "ck")
    with pytest.raises(InvalidRequest, match="stop needs durability sync"):
        await c.handle("commit", body("c1", checkpoint_dir=ck, durability="async", stop=True))
    with pytest.raises(InvalidRequest):
        await c.handle("commit", body("c1", checkpoint_dir=ck, durability="later"))
    assert c.status()["phase"] == "prepared"
    assert c.status()["writes_in_flight"] == 0
    with pytest.raises(CheckpointConflict):
        await c.handle("commit", body("c9", checkpoint_dir=ck, durability="async"))
    await c.handle("resume", body("c1"))
    await c.aclose()


async def test_no_change_to_nested_live_state_after_the_capture_reaches_the_file(
    tmp_path: pathlib.Path,
) -> None:
    """The capture copies containers and shares leaves: every way of changing
    a nested container afterwards (in place, through shared references, key
    order) must leave the written bytes as they were at the capture."""
    from ray_ckpt.storage.records.records_format import StateEncoder

    c, p, store = make()
    shared = {"deep": [1, {"x": "y"}]}
    state: dict[str, Any] = {
        "turns": [{"role": "tool", "out": "a" * 500, "meta": {"tags": ["t1", "t2"]}}],
        "grid": [[1.5, 2.5], [float("inf"), -0.0]],
        "blob": b"\x00\x01",
        "twice": [shared, shared],
        "order": {"b": 1, "a": 2},
    }
    expected = StateEncoder().encode_state(state)
    p.start("r1", at_boundary=True, state=state)
    await c.handle("prepare", body("c1"))
    ck = str(tmp_path / "ck")
    await c.handle("commit", body("c1", checkpoint_dir=ck, durability="async"))
    await c.handle("resume", body("c1"))
    # Mutate every level of the live state while the write is held.
    state["turns"][0]["meta"]["tags"].append("t3")
    state["turns"][0]["out"] = "changed"
    state["turns"].append({"role": "new"})
    state["grid"][1][0] = 0.0
    state["grid"].reverse()
    state["blob"] = b"changed"
    shared["deep"][1]["x"] = "z"
    shared["deep"].append(3)
    del state["order"]["b"]
    state["order"]["b"] = 1  # same keys and values, other order
    store.gate.set()
    final = await c.handle("commit", body("c1", checkpoint_dir=ck, durability="async"))
    assert final["manifest"]["record_count"] == 1
    frame = (tmp_path / "ck").rglob("records-*.msgpack")
    data = next(frame).read_bytes()
    assert data.endswith(expected)  # the very bytes of the state at the capture
    await c.aclose()


async def test_a_state_the_capture_refuses_fails_the_commit_and_changes_nothing(
    tmp_path: pathlib.Path,
) -> None:
    """A state the copy has to change (a set becomes a list) is refused under
    the pause, with `check_json`'s error."""
    c, p, store = make()
    p.start("r1", at_boundary=True, state={"turns": [{"ok": 1}, {"bad": {1, 2}}]})
    await c.handle("prepare", body("c1"))
    ck = tmp_path / "ck"
    with pytest.raises(InvalidCheckpointState, match=r"state\.turns\[1\]\.bad is a set"):
        await c.handle("commit", body("c1", checkpoint_dir=str(ck), durability="async"))
    assert c.status()["phase"] == "prepared"
    assert c.status()["writes_in_flight"] == 0
    assert not store.started.is_set()
    assert not ck.exists()
    await c.handle("resume", body("c1"))
    await c.aclose()


async def test_a_copy_the_audit_refuses_fails_the_pending_checkpoint_and_publishes_nothing(
    tmp_path: pathlib.Path,
) -> None:
    """A tuple survives the copy as a tuple: the write's audit, as it reads
    the copies after the resume, refuses it with the typed error naming the
    path; no file is left, and the participant takes the next checkpoint."""
    c, p, store = make()
    state: dict[str, Any] = {"turns": [{"ok": 1}, {"bad": (1, 2)}]}
    p.start("r1", at_boundary=True, state=state)
    await c.handle("prepare", body("c1"))
    ck = tmp_path / "ck"
    reply = await c.handle("commit", body("c1", checkpoint_dir=str(ck), durability="async"))
    assert reply["pending"] is True
    await c.handle("resume", body("c1"))
    store.gate.set()
    with pytest.raises(InvalidCheckpointState, match=r"state\.turns\[1\]\.bad is a tuple"):
        await c.handle("commit", body("c1", checkpoint_dir=str(ck), durability="async"))
    # Refused while the store read the records: its temp file is gone too.
    assert [f for f in ck.rglob("*") if f.is_file()] == []
    assert c.status()["writes_in_flight"] == 0
    state["turns"][1]["bad"] = [1, 2]
    await c.handle("prepare", body("c2"))
    await c.handle("commit", body("c2", checkpoint_dir=str(tmp_path / "ck2"), durability="async"))
    await c.handle("resume", body("c2"))
    final = await c.handle(
        "commit", body("c2", checkpoint_dir=str(tmp_path / "ck2"), durability="async")
    )
    assert final["manifest"]["record_count"] == 1
    assert final["captured_bytes"] > 0
    await c.aclose()
