"""Two coordinators of one Gym on the shared cluster: the superseded one is fenced.

The old coordinator is an in-process engine in the driver set up as the
actor sets itself up (its epoch taken from the GCS under the actor's name,
the actor's GCS journal key, the participants registered by name), as a
coordinator on a cut-off node would still be running when Ray restarted it
elsewhere.  The new one is the real `Coordinator` actor.
"""

from __future__ import annotations

import asyncio
import pathlib

import pytest
import ray

from coordination import connect
from coordination.actor.actor_options import COORDINATOR_NAME
from coordination.actor.gcs import GcsEpochs, KvJournal, kv_key
from coordination.actor.registration import register_actor
from coordination.engine.coordinator_core import CoordinatorCore
from coordination.engine.order import Member
from ray_ckpt import EpisodeId
from ray_ckpt.errors import StaleCoordinator
from ray_ckpt.storage import open_location
from ray_ckpt.storage.root.gym_manifest import has_gym_manifest
from ray_ckpt.storage.root.pointer import read_latest
from tests.ray.coord_actors import start_host

pytestmark = pytest.mark.ray

KEYS = ("environment/env", "agent/agent")


def latest_id(root: pathlib.Path) -> str | None:
    pointer = read_latest(open_location(str(root)))
    return None if pointer is None else pointer.checkpoint_id


def test_a_superseded_coordinator_is_refused_everywhere_and_never_latest(
    namespace: str, tmp_path: pathlib.Path
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    hosts = {k: start_host(namespace, k, live=["r1"]) for k in KEYS}
    ray.get([h.status.remote() for h in hosts.values()])
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete

    # The old coordinator: takes epoch 1, checkpoints once (LATEST names it),
    # then opens a second checkpoint and is cut off before committing it.
    old = CoordinatorCore(
        journal=KvJournal(kv_key(namespace, COORDINATOR_NAME)),
        epoch=GcsEpochs(namespace, COORDINATOR_NAME).epoch(),
    )
    for key in KEYS:
        run(register_actor(old, namespace, Member.parse(key)))
    assert old.epoch is not None
    first = run(old.checkpoint(str(root / "c1"), [EpisodeId("r1")]))
    assert latest_id(root) == first.checkpoint_id
    opened = run(old.prepare())

    # Ray restarts the coordinator elsewhere: a newer epoch, and its recovery
    # aborts what the journal says the old one left open.
    gym = connect(namespace=namespace)
    assert gym.ping() == opened.checkpoint_id
    status = gym.status()
    assert status.epoch is not None
    assert status.epoch > old.epoch.value
    for h in hosts.values():
        assert ray.get(h.status.remote())["coordinator_epoch"] == status.epoch
    newer = gym.prepare()

    # Everything the old one tries is refused with stale_coordinator: by its
    # own confirm (before it clears a directory, opens or publishes) ...
    with pytest.raises(StaleCoordinator):
        run(old.commit(str(root / "c-old"), [EpisodeId("r1")]))
    assert old.open is None  # aborted: its resumes went out, refused too
    for attempt in (old.prepare(), old.checkpoint(str(root / "c-old2"))):
        with pytest.raises(StaleCoordinator):
            run(attempt)
    with pytest.raises(StaleCoordinator):
        run(old.restore(str(root / "c1"), [EpisodeId("r1")]))
    # ... and by every participant, whatever its calls still reach.
    stale = {"deadline_ts": 4e9, "coordinator_epoch": old.epoch.value}
    for h in hosts.values():
        for op, extra in (
            ("renew", {}),
            ("resume", {}),
            ("commit", {"checkpoint_dir": str(root / "c-old"), "episode_ids": None}),
        ):
            body = {"checkpoint_id": opened.checkpoint_id, **stale, **extra}
            with pytest.raises(StaleCoordinator):
                ray.get(getattr(h, op).remote(body))
    assert not has_gym_manifest(str(root / "c-old"))
    assert latest_id(root) == first.checkpoint_id
    for h in hosts.values():
        assert ray.get(h.status.remote())["fenced"]["stale_coordinator"] >= 4

    # The new one's checkpoint, open all along, commits and becomes latest.
    gym.commit(str(root / "c2"), scope=["r1"])
    gym.resume()
    assert latest_id(root) == newer.checkpoint_id
    run(old.aclose())
    loop.close()

    # And restores: a fresh fleet from `latest`.
    for h in hosts.values():
        ray.kill(h, no_restart=True)
    fresh = {k: start_host(namespace, k) for k in KEYS}
    ray.get([h.status.remote() for h in fresh.values()])
    restored = gym.restore(str(root), latest=True)
    assert restored.source_checkpoint_id == newer.checkpoint_id
    assert restored.restored == {k: ["r1-a1"] for k in KEYS}
