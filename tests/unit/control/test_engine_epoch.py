"""The coordinator-epoch rule at one participant (pure engine, no transport).

A call carrying an epoch older than the newest this participant has seen is
refused `stale_coordinator` before it touches anything; an equal or newer one
is admitted (and becomes the newest); a call without one -- NeMo Gym's own
controller sends none -- is admitted as before.
"""

from __future__ import annotations

import aiohttp
import pytest

from ray_ckpt import ManualClock
from ray_ckpt.control.client import ControlClient
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.control.routes import CHECKPOINT_ROUTE_PREFIX, control_app
from ray_ckpt.errors import (
    CheckpointConflict,
    InvalidRequest,
    Reason,
    StaleCheckpoint,
    StaleCoordinator,
    error_from_code,
)
from ray_ckpt.settings import CheckpointSettings
from tests.unit.conftest import Serve
from tests.unit.fakes import FakeParticipant, MemoryStore
from tests.unit.helpers import T0, body_t0


def make() -> tuple[ParticipantEngine, FakeParticipant, MemoryStore]:
    p = FakeParticipant()
    store = MemoryStore()
    settings = CheckpointSettings(enabled=True, control_auth_token="t", lease_grace_seconds=600.0)
    c = ParticipantEngine(p, instance="env0", settings=settings, clock=ManualClock(T0), store=store)
    return c, p, store


def test_stale_coordinator_is_a_typed_409_that_survives_the_wire() -> None:
    err = StaleCoordinator("x")
    assert err.code == "stale_coordinator"
    assert err.http_status == 409
    assert not err.retryable
    assert isinstance(error_from_code("stale_coordinator", "x"), StaleCoordinator)


async def test_fresh_participant_takes_the_first_epoch_and_shows_it() -> None:
    c, _, _ = make()
    assert c.status()["coordinator_epoch"] is None
    assert c.status()["fenced"] == {}
    await c.handle("prepare", body_t0("c1", coordinator_epoch=3))
    assert c.status()["coordinator_epoch"] == 3


async def test_older_epoch_refused_before_anything_changes() -> None:
    c, p, store = make()
    await c.handle("prepare", body_t0("c1", coordinator_epoch=2))
    # A newer coordinator's call (its recovery's resume) raises the epoch seen.
    await c.handle("resume", body_t0("c1", coordinator_epoch=3))
    before = c.status()
    for op, extra in (
        ("prepare", {}),
        ("renew", {}),
        ("commit", {"checkpoint_dir": "/tmp/never"}),
        ("resume", {}),
        ("retire", {"episode_ids": [{"rollout_id": "r1", "attempt": 0}]}),
        ("forget", {"rollout_ids": ["r1"]}),
        ("restore", {"checkpoint_dir": "/tmp/never", "episode_ids": []}),
    ):
        with pytest.raises(StaleCoordinator) as info:
            await c.handle(op, body_t0("c2", coordinator_epoch=2, **extra))
        assert info.value.reason is Reason.STALE_COORDINATOR
    after = c.status()
    assert after["coordinator_epoch"] == 3
    assert after["fenced"] == {"stale_coordinator": 7}
    # Nothing changed: still idle, admission open, nothing stored, c2 unknown.
    assert after["phase"] == before["phase"] == "idle"
    assert p.admission_open
    assert store.writes == 0
    assert store.data == {}
    assert after["retired_rollouts"] == before["retired_rollouts"]
    reply = await c.handle("prepare", body_t0("c2", coordinator_epoch=3))
    assert reply["phase"] == "prepared"


async def test_equal_and_newer_epochs_are_admitted() -> None:
    c, _, _ = make()
    await c.handle("prepare", body_t0("c1", coordinator_epoch=5))
    assert (await c.handle("prepare", body_t0("c1", coordinator_epoch=5)))["phase"] == "prepared"
    await c.handle("resume", body_t0("c1", coordinator_epoch=9))
    assert c.status()["coordinator_epoch"] == 9
    assert c.status()["fenced"] == {}


async def test_call_without_epoch_is_admitted_as_before() -> None:
    """NeMo Gym's controller sends no epoch: never fenced by it, even after
    an epoch was seen, and it does not lower the newest."""
    c, _, _ = make()
    await c.handle("prepare", body_t0("c1", coordinator_epoch=4))
    await c.handle("resume", body_t0("c1"))
    assert (await c.handle("prepare", body_t0("c2")))["phase"] == "prepared"
    assert c.status()["coordinator_epoch"] == 4


async def test_bad_epoch_values_are_invalid_requests() -> None:
    c, _, _ = make()
    for bad in (-1, "3", 1.5, True, 2**60):
        with pytest.raises(InvalidRequest):
            await c.handle("prepare", body_t0("c1", coordinator_epoch=bad))
    assert c.status()["coordinator_epoch"] is None
    assert c.status()["phase"] == "idle"


async def test_stale_checkpoint_refusals_are_counted_as_fenced_too() -> None:
    c, _, _ = make()
    await c.handle("prepare", body_t0("c1"))
    await c.handle("resume", body_t0("c1"))
    with pytest.raises(StaleCheckpoint):
        await c.handle("prepare", body_t0("c1"))
    assert c.status()["fenced"] == {"stale_checkpoint": 1}


async def test_a_newer_coordinator_ends_the_older_ones_open_checkpoint() -> None:
    """The old coordinator's checkpoint (one the newer one's journal never
    named) would keep admission closed and refuse the newer one's prepare
    until its lease lapsed; the newer one's first call ends it instead."""
    c, p, _ = make()
    await c.handle("prepare", body_t0("old", coordinator_epoch=1))
    assert not p.admission_open
    reply = await c.handle("prepare", body_t0("new", coordinator_epoch=2))
    assert reply["phase"] == "prepared"
    assert c.status()["checkpoint_id"] == "new"
    # Ended as a lapsed lease ends it: its ID is resumed, a late call of it stale.
    with pytest.raises(StaleCoordinator):
        await c.handle("commit", body_t0("old", coordinator_epoch=1, checkpoint_dir="/x"))
    with pytest.raises(StaleCheckpoint):
        await c.handle("prepare", body_t0("old", coordinator_epoch=2))


async def test_the_newer_coordinators_own_checkpoint_and_epochless_ones_are_kept() -> None:
    c, p, _ = make()
    # Opened by the newer epoch itself: its later calls never end it.
    await c.handle("prepare", body_t0("c1", coordinator_epoch=2))
    await c.handle("renew", body_t0("c1", coordinator_epoch=2))
    assert c.status()["checkpoint_id"] == "c1"
    # The recovery's resume of the old checkpoint ends it by resuming it.
    await c.handle("resume", body_t0("c1", coordinator_epoch=3))
    # Opened without an epoch (NeMo Gym's controller): never superseded.
    await c.handle("prepare", body_t0("nemo"))
    with pytest.raises(CheckpointConflict):
        await c.handle("prepare", body_t0("c2", coordinator_epoch=4))
    assert c.status()["checkpoint_id"] == "nemo"
    assert not p.admission_open


async def test_over_http_a_stale_epoch_is_409_stale_coordinator_and_typed_at_the_client(
    serve: Serve,
) -> None:
    c, _, _ = make()
    base = await serve(control_app(c, token="t", max_body_bytes=65536))
    client = ControlClient(base, token="t", limit=2, limit_per_host=2)
    try:
        await client.call("prepare", body_t0("c1", coordinator_epoch=2))
        status = await client.status()
        assert status["coordinator_epoch"] == 2
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"{base}{CHECKPOINT_ROUTE_PREFIX}/renew",
                json=body_t0("c1", coordinator_epoch=1),
                headers={"Authorization": "Bearer t"},
            ) as resp,
        ):
            assert resp.status == 409
            assert (await resp.json())["error"]["code"] == "stale_coordinator"
        with pytest.raises(StaleCoordinator):
            await client.call("resume", body_t0("c1", coordinator_epoch=1))
        assert (await client.status())["fenced"] == {"stale_coordinator": 2}
    finally:
        await client.aclose()
