"""Restoring a checkpoint NeMo Gym's controller wrote: no Gym manifest (real HTTP, real files).

NeMo Gym's controller commits every participant into one directory and
writes no ``gym/_manifest.json``.  Our coordinator refuses such a directory
unless the caller opts in (`allow_without_gym_manifest=True`); then it
restores once every participant's manifest is there, complete, and all are
of one checkpoint ID.  The participants are the NeMo Gym-shaped test
doubles of the conformance suite, on loopback.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from coordination.engine.coordinator_core import CoordinatorCore
from coordination.engine.journal import Journal
from coordination.engine.order import Member
from coordination.reach.hosts import HttpHost
from ray_ckpt.control.client import ControlClient
from ray_ckpt.errors import CoordinationFailed
from ray_ckpt.identity import EpisodeId
from tests.conformance.nemo_participant import NemoParticipant, make_app
from tests.unit.coordination.coord_fleet import FAST

TOKEN = "tok"
KINDS = ("environment", "model", "agent", "resources")
SCOPE = [EpisodeId("r0")]


class Fleet:
    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []

    async def start(self) -> dict[str, tuple[NemoParticipant, str]]:
        """One fresh NeMo Gym-shaped participant per kind (a new "process" each)."""
        out: dict[str, tuple[NemoParticipant, str]] = {}
        for kind in KINDS:
            p = NemoParticipant(kind, f"ng-{kind}", TOKEN)
            runner = web.AppRunner(make_app(p))
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            self.runners.append(runner)
            out[kind] = (p, f"http://{host}:{port}")
        return out

    async def aclose(self) -> None:
        for r in reversed(self.runners):
            await r.cleanup()


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = Fleet()
    yield f
    await f.aclose()


@pytest.fixture
async def core() -> AsyncIterator[CoordinatorCore]:
    c = CoordinatorCore(journal=Journal(None), timeouts=FAST)
    yield c
    await c.aclose()


def client(url: str) -> ControlClient:
    return ControlClient(url, token=TOKEN, limit=2, limit_per_host=2)


async def nemo_controller_checkpoint(
    served: dict[str, tuple[NemoParticipant, str]], root: pathlib.Path, cid: str = "ckpt-1"
) -> None:
    """What NeMo Gym's controller does: prepare in stage order, commit, resume; no Gym manifest."""
    for p, _ in served.values():
        p.start("r0", state={"at": p.kind})
    clients = {k: client(url) for k, (_, url) in served.items()}
    try:
        body = {"checkpoint_id": cid, "deadline_ts": time.time() + 5}
        for kind in KINDS:
            assert (await clients[kind].call("prepare", body))["phase"] == "prepared"
        for kind in KINDS:
            await clients[kind].call(
                "commit",
                {**body, "checkpoint_dir": str(root), "episode_ids": [{"rollout_id": "r0"}]},
            )
        for kind in reversed(KINDS):
            await clients[kind].call("resume", body)
    finally:
        for c in clients.values():
            await c.aclose()
    assert not (root / "gym" / "_manifest.json").exists()


def register(core: CoordinatorCore, served: dict[str, tuple[NemoParticipant, str]]) -> None:
    for p, url in served.values():
        core.register(HttpHost(Member(p.kind, p.instance), client(url)))


def restore_calls(served: dict[str, tuple[NemoParticipant, str]]) -> list[str]:
    return [p.kind for p, _ in served.values() for op, _ in p.calls if op == "restore"]


async def test_without_the_option_a_directory_with_no_gym_manifest_is_refused(
    fleet: Fleet, core: CoordinatorCore, tmp_path: pathlib.Path
) -> None:
    await nemo_controller_checkpoint(await fleet.start(), tmp_path)
    fresh = await fleet.start()
    register(core, fresh)
    with pytest.raises(CoordinationFailed, match="missing Gym manifest") as info:
        await core.restore(str(tmp_path), SCOPE)
    assert "allow_without_gym_manifest" in info.value.failures["gym-manifest"]["detail"]
    assert restore_calls(fresh) == []


async def test_with_the_option_it_restores_into_fresh_participants(
    fleet: Fleet, core: CoordinatorCore, tmp_path: pathlib.Path
) -> None:
    await nemo_controller_checkpoint(await fleet.start(), tmp_path)
    fresh = await fleet.start()
    register(core, fresh)
    res = await core.restore(str(tmp_path), SCOPE, allow_without_gym_manifest=True)
    assert res.source_checkpoint_id == "ckpt-1"
    assert res.restored == {f"{k}/ng-{k}": ["r0-a1"] for k in KINDS}
    assert res.continued == ["r0"]
    for p, _ in fresh.values():
        assert p.episodes["r0-a1"].state == {"at": p.kind}
        assert p.phase == "idle"


def _manifest(root: pathlib.Path, kind: str) -> pathlib.Path:
    return root / "gym" / kind / f"ng-{kind}" / "manifest.json"


def drop_manifest(root: pathlib.Path) -> None:
    _manifest(root, "agent").unlink()


def drop_participant(root: pathlib.Path) -> None:
    import shutil

    shutil.rmtree(_manifest(root, "agent").parent)


def other_checkpoint(root: pathlib.Path) -> None:
    path = _manifest(root, "agent")
    m = json.loads(path.read_text())
    path.write_text(json.dumps({**m, "checkpoint_id": "ckpt-2"}, sort_keys=True, indent=1))


def drop_records(root: pathlib.Path) -> None:
    path = _manifest(root, "agent")
    (path.parent / json.loads(path.read_text())["records_file"]).unlink()


def torn_manifest(root: pathlib.Path) -> None:
    path = _manifest(root, "agent")
    path.write_text(path.read_text()[:20])


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (drop_manifest, "missing manifest"),
        (drop_participant, "registered but not listed"),
        (other_checkpoint, "different checkpoints"),
        (drop_records, "is missing"),
        (torn_manifest, "corrupt manifest"),
    ],
)
async def test_with_the_option_an_incomplete_directory_is_still_refused_touching_nobody(
    fleet: Fleet,
    core: CoordinatorCore,
    tmp_path: pathlib.Path,
    damage: object,
    why: str,
) -> None:
    await nemo_controller_checkpoint(await fleet.start(), tmp_path)
    damage(tmp_path)  # type: ignore[operator]
    fresh = await fleet.start()
    register(core, fresh)
    with pytest.raises(CoordinationFailed) as info:
        await core.restore(str(tmp_path), SCOPE, allow_without_gym_manifest=True)
    details = [str(info.value)] + [f["detail"] for f in info.value.failures.values()]
    assert any(why in d for d in details), details
    assert restore_calls(fresh) == []
    assert core.open is None


async def test_the_cli_default_scope_without_a_gym_manifest(
    fleet: Fleet, tmp_path: pathlib.Path
) -> None:
    from coordination.cli.commands import _checkpointed_episodes
    from ray_ckpt.errors import InvalidCheckpointState, InvalidRequest
    from ray_ckpt.storage import write_participant
    from ray_ckpt.storage.records.record import Record

    nemo = tmp_path / "nemo"
    await nemo_controller_checkpoint(await fleet.start(), nemo)
    with pytest.raises(InvalidCheckpointState, match="missing Gym manifest"):
        _checkpointed_episodes(str(nemo))
    # NeMo Gym's manifests do not list their episodes: the caller names them.
    with pytest.raises(InvalidRequest, match="--episode"):
        _checkpointed_episodes(str(nemo), without_gym_manifest=True)
    ours = tmp_path / "ours"
    for kind, key in (("agent", "r1"), ("environment", "r2-a1")):
        write_participant(
            ours, kind=kind, instance="x", checkpoint_id="c1", records=[Record(key, {})]
        )
    assert _checkpointed_episodes(str(ours), without_gym_manifest=True) == ["r1", "r2-a1"]
