"""A zombie participant's late commit lands nowhere a restore reads (real files).

A participant on a cut-off node keeps running after Ray replaced it: the
commit write the coordinator started there before the cut goes on and lands
after the coordinator gave up on that checkpoint.  What keeps it out of every
restore: a directory without a Gym manifest is never restored nor `latest`,
a retry into it clears what landed there first, and a participant manifest
is created, never replaced, so one landing after the retry's commit is
refused while the Gym manifest names the replacement's by its digest.  Real
participant engines over the real file store; the real Gym-manifest writer,
reader, directory guard and `LATEST`.
"""

from __future__ import annotations

import pathlib
import threading
from typing import Any

import pytest

from coordination.engine.coordinator_core import CoordinatorCore
from coordination.engine.order import Member
from coordination.engine.roots import restore_target
from coordination.reach.hosts import FakeHost
from ray_ckpt import EpisodeId
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import CoordinationFailed, InvalidCheckpointState, ParticipantUnavailable
from ray_ckpt.storage import verify_checkpoint
from ray_ckpt.storage.root.gym_manifest import read_gym_manifest
from ray_ckpt.storage.seam import FileRecordStore
from tests.unit.coordination.coord_fleet import FAST, SETTINGS
from tests.unit.fakes import FakeParticipant
from tests.unit.helpers import until

KEYS = ("environment/env", "agent/agent")


class GatedStore(FileRecordStore):
    """The file store, whose writes wait while `gate` is clear (a write
    stalled on a cut-off node's storage path)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def write(self, *args: Any, **kwargs: Any) -> Any:
        self.gate.wait(30)
        return super().write(*args, **kwargs)


def launch(core: CoordinatorCore, state: dict[str, Any] | None) -> dict[str, Any]:
    """One fresh process per member (a relaunch replaces the registered one)."""
    out: dict[str, Any] = {}
    for key in KEYS:
        m = Member.parse(key)
        part = FakeParticipant(m.kind)
        if state is not None:
            part.start("r1", at_boundary=True, state=state)
        engine = ParticipantEngine(part, instance=m.name, settings=SETTINGS, store=GatedStore())
        host = FakeHost(m, engine)
        core.register(host)
        out[key] = (part, engine, host)
    return out


@pytest.mark.parametrize("lands", ["before_the_retry", "after_the_retry"])
async def test_a_zombies_late_commit_lands_nowhere_a_restore_reads(
    tmp_path: pathlib.Path, lands: str
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    core = CoordinatorCore(timeouts=FAST)
    first = launch(core, {"step": 3})
    c1 = await core.checkpoint(str(root / "c1"), [EpisodeId("r1")])

    # c2: the environment's write stalls and its node is cut; the commit
    # times out, the abort's resume never reaches it: it stays a zombie
    # whose write is still under way.
    _, zombie, zombie_host = first["environment/env"]
    zombie.store.gate.clear()
    zombie_host.fail["resume"] = ParticipantUnavailable("node cut off")
    with pytest.raises(CoordinationFailed):
        await core.checkpoint(str(root / "c2"), [EpisodeId("r1")])
    assert zombie.writes_in_flight == 1
    zombie_manifest = root / "c2" / "gym" / "environment" / "env" / "manifest.json"

    async def zombie_write_lands() -> None:
        zombie.store.gate.set()
        await until(lambda: zombie.writes_in_flight == 0)

    if lands == "before_the_retry":
        await zombie_write_lands()
        assert zombie_manifest.exists()  # it landed, in a checkpoint never completed
    where, _ = await restore_target(str(root), None, latest=True)
    assert where == str(root / "c1")

    # Ray relaunched the members: the fresh Gym restores c1, refuses c2.
    fresh = launch(core, None)
    with pytest.raises(CoordinationFailed, match="Gym manifest"):
        await core.restore(str(root / "c2"), [EpisodeId("r1")])
    restored = await core.restore(where, [EpisodeId("r1")])
    assert restored.source_checkpoint_id == c1.checkpoint_id
    assert fresh["environment/env"][0].restored == {"r1-a1": {"step": 3}}

    # The trainer retries into c2's directory with the replacements.
    fresh["environment/env"][0].restored["r1-a1"] = {"step": 4}
    c3 = await core.checkpoint(str(root / "c2"), [EpisodeId("r1", 1)])
    committed = zombie_manifest.read_bytes()
    if lands == "after_the_retry":
        await zombie_write_lands()  # refused: a manifest is never replaced
        [write] = zombie._writes.values()
        assert write.task is not None
        assert isinstance(write.task.exception(), InvalidCheckpointState)
    assert zombie_manifest.read_bytes() == committed
    assert read_gym_manifest(str(root / "c2")).checkpoint_id == c3.checkpoint_id
    assert verify_checkpoint(str(root / "c2")).ok
    where, _ = await restore_target(str(root), None, latest=True)
    assert where == str(root / "c2")

    again = launch(core, None)
    restored = await core.restore(where, [EpisodeId("r1", 1)])
    assert restored.source_checkpoint_id == c3.checkpoint_id
    assert again["environment/env"][0].restored == {"r1-a2": {"step": 4}}
    for members in (first, fresh, again):
        for _, engine, _ in members.values():
            await engine.aclose()
    await core.aclose()
