"""A superseded coordinator publishes nothing: the engine's epoch checks (no Ray).

A newer incarnation takes a newer epoch (`MemoryEpochs`, as the GCS sequence
does on Ray) without having reached any participant yet, so only the
engine's own confirm stands between the old coordinator and a Gym manifest
or `LATEST`.
"""

from __future__ import annotations

import pathlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from coordination.engine.coordinator_core import CoordinatorCore
from coordination.engine.epoch import CoordinatorEpoch, MemoryEpochs
from coordination.engine.options import CheckpointOptions
from coordination.engine.order import Member
from coordination.reach.hosts import FakeHost
from ray_ckpt import EpisodeId
from ray_ckpt.errors import CoordinationFailed, StaleCoordinator
from tests.unit.coordination.coord_fleet import FAST, Fleet, make_fleet
from tests.unit.helpers import until


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = make_fleet(("environment/env", "agent/agent"))
    # Registered as the actor registers them: status first, which shows the
    # participant takes epochs.
    for host in f.hosts.values():
        await f.core.register_checked(host)
    yield f
    await f.aclose()


def sent_epochs(f: Fleet, op: str) -> set[Any]:
    return {
        body.get("coordinator_epoch") for h in f.hosts.values() for o, body in h.calls if o == op
    }


async def test_every_control_call_carries_the_epoch(fleet: Fleet) -> None:
    epochs = MemoryEpochs()
    fleet.core.epoch = epochs.epoch()
    fleet.parts["environment/env"].start("r1", at_boundary=True, state={"step": 1})
    await fleet.core.checkpoint("/ck", [EpisodeId("r1")])
    for op in ("prepare", "commit", "resume"):
        assert sent_epochs(fleet, op) == {1}
    assert {c.status()["coordinator_epoch"] for c in fleet.ctrls.values()} == {1}
    assert (await fleet.core.status()).epoch == 1


async def test_superseded_between_prepare_and_commit_never_publishes(fleet: Fleet) -> None:
    epochs = MemoryEpochs()
    fleet.core.epoch = epochs.epoch()
    fleet.latests.append(("/root/earlier", "ckpt-earlier"))  # what LATEST named before
    fleet.core.directory_guard = None  # the publish's own confirm, not the guard's
    fleet.parts["environment/env"].start("r1", at_boundary=True, state={"step": 1})
    await fleet.core.prepare()
    epochs.take()  # a restarted coordinator, not yet heard from by anyone
    with pytest.raises(StaleCoordinator, match="Gym manifest"):
        await fleet.core.commit("/root/ck-old", [EpisodeId("r1")])
    assert fleet.manifests == []
    assert fleet.latests == [("/root/earlier", "ckpt-earlier")]
    # Failed typed and aborted: nothing left open here or at the participants.
    assert fleet.core.open is None
    assert set(fleet.phases().values()) == {"idle"}
    assert fleet.core.last_checkpoint is None


async def test_superseded_coordinator_opens_nothing(fleet: Fleet) -> None:
    epochs = MemoryEpochs()
    fleet.core.epoch = epochs.epoch()
    epochs.take()
    with pytest.raises(StaleCoordinator, match="opening a checkpoint"):
        await fleet.core.checkpoint("/root/ck")
    with pytest.raises(StaleCoordinator):
        await fleet.core.prepare()
    with pytest.raises(StaleCoordinator, match="opening a restore"):
        await fleet.core.restore("/root/ck", [EpisodeId("r1")])
    assert all(h.calls == [] for h in fleet.hosts.values())  # nobody was paused
    assert fleet.manifests == []


async def test_superseded_after_the_gym_manifest_leaves_latest_alone(fleet: Fleet) -> None:
    """A newer coordinator starting between the Gym manifest and `LATEST`:
    the checkpoint is complete, yet never named `latest` by the old one."""
    epochs = MemoryEpochs()
    fleet.core.epoch = epochs.epoch()
    write = fleet.core.manifest_writer

    def writer_then_superseded(d: str, cid: str, ms: list[dict[str, Any]]) -> Any:
        out = write(d, cid, ms)
        epochs.take()
        return out

    fleet.core.manifest_writer = writer_then_superseded
    fleet.parts["environment/env"].start("r1", at_boundary=True, state={"step": 1})
    await fleet.core.checkpoint("/root/ck", [EpisodeId("r1")])
    assert len(fleet.manifests) == 1
    assert fleet.latests == []


async def test_asynchronous_checkpoint_superseded_before_durable_never_publishes(
    fleet: Fleet,
) -> None:
    epochs = MemoryEpochs()
    fleet.core.epoch = epochs.epoch()
    fleet.parts["environment/env"].start("r1", at_boundary=True, state={"step": 1})
    fleet.store.write_gate = gate = threading.Event()
    result = await fleet.core.checkpoint(
        CheckpointOptions(checkpoint_dir="/root/ck", scope=[EpisodeId("r1")], durability="async")
    )
    assert result.pending
    epochs.take()
    gate.set()
    with pytest.raises(StaleCoordinator):
        await fleet.core.durable(result.checkpoint_id)
    assert fleet.manifests == []
    assert fleet.latests == []


async def test_an_unconfirmable_epoch_counts_as_stale(fleet: Fleet) -> None:
    """A coordinator cut off from the GCS cannot confirm: it publishes nothing."""
    hang = threading.Event()

    def newest() -> int:
        hang.wait(5)
        return 1

    fleet.core.epoch = CoordinatorEpoch(1, newest, timeout_s=0.05)
    try:
        with pytest.raises(StaleCoordinator, match="could not be confirmed"):
            await fleet.core.checkpoint("/root/ck")
    finally:
        hang.set()
    assert all(h.calls == [] for h in fleet.hosts.values())


async def test_participant_without_epochs_is_sent_none(fleet: Fleet) -> None:
    """NeMo Gym's participants refuse unknown body fields: one whose status
    does not show `coordinator_epoch` never gets it."""
    fleet.core.epoch = MemoryEpochs().epoch()

    def nemo_like(op: str, body: dict[str, Any]) -> dict[str, Any]:
        assert "coordinator_epoch" not in body
        if op == "prepare":
            return {"phase": "prepared", "report": {"ready": True}}
        return {"phase": "idle"}

    nemo = FakeHost(Member.parse("resources/nemo"), reply=nemo_like)
    await fleet.core.register_checked(nemo)
    await fleet.core.prepare()
    await fleet.core.resume()
    assert [op for op, _ in nemo.calls] == ["prepare", "resume"]
    assert all("coordinator_epoch" not in body for _, body in nemo.calls)
    assert sent_epochs(fleet, "prepare") == {1}


async def test_a_superseded_coordinator_never_overwrites_the_newer_ones_journal(
    fleet: Fleet,
) -> None:
    """Both incarnations share one journal key (the actor's name): the old
    one's entries would make a later recovery abort the wrong checkpoint,
    and its clear would hide the newer one's open checkpoint."""
    epochs = MemoryEpochs()
    old = fleet.core
    old.epoch = epochs.epoch()
    old.directory_guard = None  # the participants' refusal, not the guard's
    await old.prepare()
    # The restarted coordinator: same journal, same participants, newer epoch.
    new = CoordinatorCore(
        journal=old.journal, timeouts=old.timeouts, manifest_writer=old.manifest_writer
    )
    new.epoch = epochs.epoch()
    for key, ctrl in fleet.ctrls.items():
        await new.register_checked(FakeHost(Member.parse(key), ctrl))
    assert old.open is not None
    assert await new.recover() == old.open.checkpoint_id
    opened = await new.prepare()
    assert old.journal.load().checkpoint_id == opened.checkpoint_id
    with pytest.raises(CoordinationFailed) as info:
        await old.commit("/root/ck-old")
    assert {f["code"] for f in info.value.failures.values()} == {"stale_coordinator"}
    assert old.open is None
    await old.settle_journal()  # its close's clear, if it made one, has landed
    entry = old.journal.load()
    assert entry is not None
    assert entry.checkpoint_id == opened.checkpoint_id
    await new.commit("/root/ck-new")
    await new.resume()
    assert [cid for _, cid, _ in fleet.manifests] == [opened.checkpoint_id]
    assert {c.status()["fenced"].get("stale_coordinator", 0) > 0 for c in fleet.ctrls.values()} == {
        True
    }
    await new.aclose()


async def test_a_failing_epoch_store_counts_as_stale_and_leaves_latest_alone(
    fleet: Fleet,
) -> None:
    """The GCS refusing the read is no confirmation: typed, so the publish
    fails, and the `LATEST` write (which never raises) is skipped."""
    calls = 0

    def newest() -> int:
        nonlocal calls
        calls += 1
        if calls > 1:  # the opening's confirm passes; the ones after fail
            raise ConnectionError("GCS unavailable")
        return 1

    fleet.core.epoch = CoordinatorEpoch(1, newest)
    with pytest.raises(StaleCoordinator, match="epoch store failed"):
        await fleet.core.checkpoint("/root/ck")
    assert fleet.manifests == []
    fleet.core.epoch = None
    await fleet.core.checkpoint("/root/ck2")
    calls = 1
    fleet.core.epoch = CoordinatorEpoch(1, newest)
    before = list(fleet.latests)
    await fleet.core._write_latest("/root/ck2", "ckpt-x")
    assert fleet.latests == before


async def test_a_member_unreachable_at_registration_is_asked_before_the_next_opening(
    fleet: Fleet,
) -> None:
    """A slow start: its status did not answer when it was registered, so
    whether it takes epochs was unknown; it is asked before the next
    checkpoint opens, and fenced from then on."""
    fleet.core.epoch = MemoryEpochs().epoch()
    slow = fleet.add("environment/slow", register=False)
    slow.dead = True
    await fleet.core.register_checked(slow)  # unreachable: registered unchecked
    slow.dead = False
    await fleet.core.checkpoint("/root/ck")
    assert {b.get("coordinator_epoch") for o, b in slow.calls if o == "prepare"} == {1}
    assert fleet.ctrls["environment/slow"].status()["coordinator_epoch"] == 1


async def test_a_superseded_coordinator_deletes_nothing_the_newer_one_commits(
    fleet: Fleet, tmp_path: pathlib.Path
) -> None:
    """The directory guard deletes what an aborted checkpoint left under
    `gym/`; run by the old coordinator on the directory a trainer's retry
    gave the newer one, it would delete the newer one's commit under way
    (or, racing its Gym manifest, a complete checkpoint's files)."""
    epochs = MemoryEpochs()
    fleet.core.epoch = epochs.epoch()
    await fleet.core.prepare()
    epochs.take()
    where = tmp_path / "ck"
    newer = where / "gym" / "environment" / "env" / "manifest.json"
    newer.parent.mkdir(parents=True)
    newer.write_text('{"checkpoint_id": "ckpt-newer"}')
    with pytest.raises(StaleCoordinator, match="clearing"):
        await fleet.core.commit(str(where))
    assert newer.read_text() == '{"checkpoint_id": "ckpt-newer"}'
    # Aborted, not left prepared: it can never be published.
    assert fleet.core.open is None
    assert set(fleet.phases().values()) == {"idle"}


async def test_a_superseded_coordinator_stops_renewing_and_resumes_its_open_checkpoint() -> None:
    """A split checkpoint left prepared (the trainer's commit now goes to the
    newer coordinator): the renewer's confirm finds the newer epoch, renews
    nobody any more and aborts it, so no participant stays paused."""
    f = make_fleet(
        ("environment/env", "agent/agent"),
        timeouts=msgspec.structs.replace(FAST, renew_every_s=0.05),
    )
    try:
        for host in f.hosts.values():
            await f.core.register_checked(host)
        epochs = MemoryEpochs()
        f.core.epoch = epochs.epoch()
        await f.core.prepare()
        await until(lambda: f.events("renew"))  # renewing while current
        epochs.take()
        await until(lambda: f.core.open is None)
        assert set(f.phases().values()) == {"idle"}
        assert f.core.renewer._task is None  # renews nobody any more
    finally:
        await f.aclose()
