"""Our coordinator (`CoordinatorCore`, in process, HTTP hosts) drives NeMo Gym-shaped participants.

Four participants, one per kind, each running the NeMo Gym-shaped control
plane (`nemo_participant`) on loopback.  Tests that fail today for a reason
§1.18 of the reference notes gives are `xfail(strict=True)`: they turn into
failures the moment the fix lands, so whoever fixes it removes the mark.
The first assertion that fails in each names the §1.18 point.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from coordination.engine.coordinator_core import CoordinatorCore
from coordination.engine.journal import Journal
from coordination.engine.order import Member
from coordination.engine.results import Timeouts
from coordination.reach.hosts import HttpHost
from ray_ckpt.control.client import ControlClient
from ray_ckpt.errors import CheckpointError, CoordinationFailed, InvalidRequest, RestartInScope
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage import read_gym_manifest
from tests.conformance.conftest import KINDS, TOKEN, Serve, Served

TIMEOUTS = Timeouts(
    prepare_s=0.3,
    commit_s=5.0,
    resume_s=5.0,
    restore_s=5.0,
    retire_s=5.0,
    status_s=2.0,
    pause_s=1.0,
    renew_every_s=3600.0,
    reply_grace_s=1.0,
    cleanup_min_s=5.0,
)
BLOCKERS = "§1.18: report.blockers are capture-key strings; our coordinator crashes on them"
MANIFEST = (
    "§1.18: participant manifests in NeMo Gym's shape (records_sha256, record_count, "
    "records-<sha>.jsonl); our Gym-manifest writer requires our own fields"
)
VALIDATION = "§1.18: a FastAPI 422 {'detail': [...]} must become a typed InvalidRequest"


def host(s: Served) -> HttpHost:
    p = s.participant
    client = ControlClient(s.url, token=TOKEN, limit=8, limit_per_host=4, grace_s=1.0)
    return HttpHost(Member(p.kind, p.instance), client)


@pytest.fixture
async def core() -> AsyncIterator[CoordinatorCore]:
    c = CoordinatorCore(journal=Journal(None), timeouts=TIMEOUTS)
    yield c
    await c.aclose()


def register(core: CoordinatorCore, fleet: dict[str, Served]) -> None:
    for s in fleet.values():
        core.register(host(s))


def start_everywhere(fleet: dict[str, Served], rollout: str, attempt: int = 0, **kw: bool) -> None:
    for s in fleet.values():
        s.participant.start(rollout, attempt, state={"at": s.participant.kind, "r": rollout})
    for kind, flag in kw.items():
        fleet[kind].participant.episodes[EpisodeId(rollout, attempt).capture_key].blocking = flag


async def straggler_prepare(core: CoordinatorCore, fleet: dict[str, Served]) -> None:
    """A prepare the agent's straggler makes miss: typed failure, nothing left open."""
    try:
        await core.prepare(0.3)
    except CoordinationFailed as exc:
        failed = exc
    except Exception as exc:
        pytest.fail(f"{BLOCKERS}: prepare raised {exc!r}")
    else:
        pytest.fail("prepare succeeded past a straggler")
    assert failed.failures["agent/ng-agent"]["blockers"] == ["r1"], BLOCKERS
    assert {s.participant.phase for s in fleet.values()} == {"idle"}, (
        f"{BLOCKERS}: the failed prepare left the checkpoint open"
    )
    assert core.open is None
    # Prepare stopped at the agent stage: resources were resumed, never prepared.
    ops = [op for op, _ in fleet["resources"].participant.calls]
    assert "prepare" not in ops
    assert ops[-1] == "resume"


async def test_a_straggler_reported_as_string_blockers_fails_typed_and_resumes_everyone(
    nemo_fleet: dict[str, Served], core: CoordinatorCore
) -> None:
    register(core, nemo_fleet)
    start_everywhere(nemo_fleet, "r1", agent=True)
    await straggler_prepare(core, nemo_fleet)


async def test_a_commit_of_nemo_shaped_participant_manifests(
    nemo_fleet: dict[str, Served], core: CoordinatorCore, tmp_path: Path
) -> None:
    register(core, nemo_fleet)
    start_everywhere(nemo_fleet, "r0")
    await core.prepare(5.0)
    try:
        committed = await core.commit(str(tmp_path), [EpisodeId("r0")])
    except CheckpointError as exc:
        pytest.fail(f"{MANIFEST}: commit raised {exc!r}")
    assert committed.episode_ids == {f"{k}/ng-{k}": ["r0"] for k in KINDS}
    assert (tmp_path / "gym" / "_manifest.json").exists()
    # What was written: NeMo Gym's manifests carry no `bytes`; the records
    # objects' sizes are what the Gym manifest lists and the commit reports.
    listed = {
        f"{e.kind}/{e.instance}": e.bytes for e in read_gym_manifest(str(tmp_path)).participants
    }
    on_disk = {
        f"{k}/ng-{k}": sum(
            f.stat().st_size for f in (tmp_path / "gym" / k / f"ng-{k}").glob("records*")
        )
        for k in KINDS
    }
    assert listed == on_disk
    assert all(size > 0 for size in on_disk.values())
    assert committed.bytes == on_disk
    await core.resume()
    assert {s.participant.phase for s in nemo_fleet.values()} == {"idle"}


async def test_a_full_cycle_straggler_restart_commit_restore_fresh_retire_forget(
    nemo_fleet: dict[str, Served], core: CoordinatorCore, serve_nemo: Serve, tmp_path: Path
) -> None:
    register(core, nemo_fleet)
    start_everywhere(nemo_fleet, "r0")
    start_everywhere(nemo_fleet, "r1", agent=True)
    nemo_fleet["resources"].participant.start("r2", restart=True)
    for kind in ("environment", "model", "agent"):
        nemo_fleet[kind].participant.start("r2")

    # The straggler: prepare misses, everyone resumed; retire it; re-run as attempt 1.
    await straggler_prepare(core, nemo_fleet)
    retired = await core.retire([EpisodeId("r1")])
    assert retired.retired == {f"{k}/ng-{k}": ["r1"] for k in KINDS}
    assert all(s.participant.marks == {"r1": 0} for s in nemo_fleet.values())
    start_everywhere(nemo_fleet, "r1", 1)

    # Prepare again: the restart is reported and kept out of the scope.
    prepared = await core.prepare(5.0)
    assert prepared.restarts == {"resources/ng-resources": ["r2"]}
    scope = [EpisodeId("r0"), EpisodeId("r1", 1)]
    try:
        committed = await core.commit(str(tmp_path), scope)
    except CheckpointError as exc:
        pytest.fail(f"{MANIFEST}: commit raised {exc!r}")
    assert committed.continued == ["r0", "r1-a1"]
    assert committed.restart == []
    assert (await core.resume()).failures == {}

    # Restore into fresh participants (new apps, the same names).
    fresh = {kind: await serve_nemo(kind) for kind in KINDS}
    register(core, fresh)
    restored = await core.restore(str(tmp_path), scope)
    assert restored.restored == {f"{k}/ng-{k}": ["r0-a1", "r1-a2"] for k in KINDS}
    assert restored.continued == ["r0", "r1-a1"]
    assert {s.participant.phase for s in fresh.values()} == {"idle"}
    assert fresh["model"].participant.episodes["r1-a2"].state == {"at": "model", "r": "r1"}

    # Retire the restart-only rollout and forget everything.
    await core.retire([EpisodeId("r2")])
    await core.forget(["r0", "r1", "r2"])
    assert all(s.participant.status()["retired_rollouts"] == 0 for s in fresh.values())


async def test_a_fastapi_validation_reply_is_a_typed_invalid_request(
    nemo_fleet: dict[str, Served],
) -> None:
    client = ControlClient(nemo_fleet["model"].url, token=TOKEN, limit=2, limit_per_host=2)
    try:
        with pytest.raises(InvalidRequest, match="extra_forbidden"):
            await client.call("prepare", {"checkpoint_id": "c1", "deadline_ts": time.time() + 5,
                                          "unknown": 1})  # fmt: skip
    finally:
        await client.aclose()


@pytest.mark.parametrize("named", ["r2", "ghost"], ids=["restart-only", "no-state"])
async def test_a_strict_commit_naming_an_episode_that_would_start_over_is_restart_in_scope(
    nemo_fleet: dict[str, Served], core: CoordinatorCore, tmp_path: Path, named: str
) -> None:
    """One cause, one typed error: the scope names an episode no participant
    will continue, whether a participant refuses it (restart-only: NeMo Gym's
    participants fail closed) or none holds state for it."""
    register(core, nemo_fleet)
    start_everywhere(nemo_fleet, "r0")
    nemo_fleet["resources"].participant.start("r2", restart=True)
    for kind in ("environment", "model", "agent"):
        nemo_fleet[kind].participant.start("r2")
    await core.prepare(5.0)
    with pytest.raises(RestartInScope) as info:
        await core.commit(str(tmp_path), [EpisodeId("r0"), EpisodeId(named)], strict=True)
    assert named in info.value.detail
    assert not (tmp_path / "gym" / "_manifest.json").exists()
    assert core.open is None
    assert {s.participant.phase for s in nemo_fleet.values()} == {"idle"}
