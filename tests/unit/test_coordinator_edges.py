"""Edges of the coordinator's entry points, over in-process participants
(`coord_fleet`: real `ParticipantController`s):

- every entry point that opens a checkpoint or a restore first waits for the
  asynchronous checkpoint still publishing, and `LATEST` never moves back to
  a checkpoint opened before the one it names.
"""

from __future__ import annotations

import pathlib
import threading
from typing import Any

from coordination.roots import write_latest_quietly
from ray_ckpt.storage import open_location
from ray_ckpt.storage.pointer import join_location, read_latest
from tests.unit.coord_fleet import Fleet, make_fleet

# How long a held-back publish waits for the event that would release it
# (only ever reached when the code under test is right and nothing sets it).
HOLD_S = 1.0


# --- 1. a pending asynchronous checkpoint publishes first ---------------------------


def _slow_publish(fleet: Fleet, slow_dir: str, gate: threading.Event) -> list[str]:
    """The Gym manifest of `slow_dir` waits for `gate` (at most HOLD_S);
    returns the order the Gym manifests were written in."""
    writer = fleet.core.manifest_writer
    order: list[str] = []

    def write(d: str, cid: str, ms: list[dict[str, Any]]) -> None:
        if d == slow_dir:
            gate.wait(HOLD_S)
        writer(d, cid, ms)
        order.append(d)

    fleet.core.manifest_writer = write
    return order


async def test_split_prepare_waits_for_the_pending_publish_so_latest_ends_on_the_newer() -> None:
    fleet = make_fleet()
    gate = threading.Event()
    published = _slow_publish(fleet, "/r/a", gate)
    latest = fleet.core.latest_writer
    assert latest is not None

    def latest_then_release(d: str, cid: str) -> None:
        latest(d, cid)
        if d == "/r/b":
            gate.set()  # b went all the way round: let a's late publish land

    fleet.core.latest_writer = latest_then_release
    try:
        a = await fleet.core.checkpoint("/r/a", None, durability="async")
        assert a.pending
        prepared = await fleet.core.prepare()
        # a was published before b opened: its Gym manifest and LATEST are there.
        assert published == ["/r/a"]
        await fleet.core.commit("/r/b")
        await fleet.core.resume()
        await fleet.core.durable(a.checkpoint_id)
        assert published == ["/r/a", "/r/b"]
        assert fleet.latests == [("/r/a", a.checkpoint_id), ("/r/b", prepared.checkpoint_id)]
    finally:
        gate.set()
        await fleet.aclose()


async def test_latest_is_never_moved_back_to_a_checkpoint_opened_before_the_one_it_names(
    tmp_path: pathlib.Path,
) -> None:
    fleet = make_fleet()
    fleet.core.latest_writer = write_latest_quietly  # the real pointer, on disk
    root = str(tmp_path)
    try:
        a = await fleet.core.checkpoint(join_location(root, "a"), None)
        b = await fleet.core.checkpoint(join_location(root, "b"), None)
        assert read_latest(open_location(root)) is not None
        # a's publish arriving late (after b's) leaves the pointer on b.
        await fleet.core._write_latest(join_location(root, "a"), a.checkpoint_id)
        pointer = read_latest(open_location(root))
        assert pointer is not None
        assert (pointer.name, pointer.checkpoint_id) == ("b", b.checkpoint_id)
        # The same checkpoint again, or a newer one, still moves it.
        c = await fleet.core.checkpoint(join_location(root, "c"), None)
        pointer = read_latest(open_location(root))
        assert pointer is not None
        assert (pointer.name, pointer.checkpoint_id) == ("c", c.checkpoint_id)
    finally:
        await fleet.aclose()


async def test_a_latest_writer_that_raises_fails_nothing_and_leaves_nothing_open() -> None:
    fleet = make_fleet()

    def broken(d: str, cid: str) -> None:
        raise RuntimeError("pointer store down (test)")

    fleet.core.latest_writer = broken
    try:
        done = await fleet.core.checkpoint("/ck", None)
        # Complete with its Gym manifest; the pointer is only a hint.
        assert [cid for _, cid, _ in fleet.manifests] == [done.checkpoint_id]
        assert fleet.core.open is None
        assert set(fleet.phases().values()) == {"idle"}
        assert all(p.admission_open for p in fleet.parts.values())
        await fleet.core.checkpoint("/ck2", None)  # the next one is not refused
    finally:
        await fleet.aclose()


async def test_a_restore_waits_for_the_pending_publish() -> None:
    fleet = make_fleet()  # nothing served yet: every member may restore
    restores_before_publish: list[int] = []
    writer = fleet.core.manifest_writer

    def write(d: str, cid: str, ms: list[dict[str, Any]]) -> None:
        restores_before_publish.append(len(fleet.events("restore")))
        writer(d, cid, ms)

    fleet.core.manifest_writer = write
    gate = threading.Event()
    published = _slow_publish(fleet, "/r/a", gate)  # counted once the hold is over
    try:
        a = await fleet.core.checkpoint("/r/a", None, durability="async")
        await fleet.core.restore("/r/a", [])
        assert published == ["/r/a"]
        assert restores_before_publish == [0]  # published before anyone restored
        await fleet.core.durable(a.checkpoint_id)
    finally:
        gate.set()
        await fleet.aclose()
