"""Restore on the participant: never stuck, never half-open, no zombie attempt.

The real engine over a fake participant and an in-memory store, with a
manual clock for the lease; installs are slowed by gates to land a deadline,
a cancellation or a lapse while they run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest

from ray_ckpt import EpisodeId, ManualClock, Record
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.control.routes import CHECKPOINT_ROUTE_PREFIX, control_app
from ray_ckpt.errors import (
    CheckpointConflict,
    DeadlineExceeded,
    InvalidCheckpointState,
    Reason,
    StaleAttempt,
    StaleCheckpoint,
)
from ray_ckpt.settings import CheckpointSettings
from tests.unit.conftest import Serve
from tests.unit.fakes import FakeParticipant, Manifest, MemoryStore
from tests.unit.helpers import T0, body_t0

GRACE = 60.0
RESTORED_REPLY = {"phase": "restored", "source_checkpoint_id": "c0", "restored": ["r-a2"]}


class GatedParticipant(FakeParticipant):
    """Install waits for `gate`; `install_error` makes it fail halfway (after
    installing the first record), as a user's setstate might."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: asyncio.Event | None = None
        self.started = asyncio.Event()
        self.install_error: BaseException | None = None
        self.installs = 0

    async def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        self.installs += 1
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.install_error is not None:
            first = records[0]
            self.restored[first.episode_id.next().capture_key] = first.state
            raise self.install_error
        return await super().install(records)


def make() -> tuple[ParticipantEngine, GatedParticipant, ManualClock]:
    p = GatedParticipant()
    store = MemoryStore()
    store.data[("/ck", "environment", "env0")] = (
        Manifest("c0", "environment", "env0", 2),
        [Record("r-a1", {"s": 1}), Record("q", {"s": 2})],
    )
    clock = ManualClock(T0)
    settings = CheckpointSettings(enabled=True, control_auth_token="t", lease_grace_seconds=GRACE)
    c = ParticipantEngine(p, instance="env0", settings=settings, clock=clock, store=store)
    return c, p, clock


def restore_body(cid: str = "c0", deadline: float = 30.0, **extra: Any) -> dict[str, Any]:
    return {
        "checkpoint_id": cid,
        "deadline_ts": T0 + deadline,
        "checkpoint_dir": "/ck",
        "episode_ids": [{"rollout_id": "r", "attempt": 1}],
        **extra,
    }


async def miss_the_deadline(c: ParticipantEngine, p: GatedParticipant) -> None:
    """Start a restore whose install outlives its (short, real-time) deadline."""
    p.gate = asyncio.Event()
    with pytest.raises(DeadlineExceeded):
        await c.handle("restore", restore_body(deadline=0.05))
    assert p.started.is_set()


async def test_the_lease_runs_from_the_restore_start_and_resumes_a_stuck_install() -> None:
    c, p, clock = make()
    await miss_the_deadline(c, p)
    status = c.status()
    assert status["phase"] == "restored"
    assert not p.admission_open
    # Without a lease here the participant would stay closed for ever once
    # the coordinator is gone.
    assert status["lease_expires_at"] == T0 + 0.05 + GRACE
    clock.set(T0 + 0.05 + GRACE - 1e-6)
    assert not await c.check_lease()
    clock.set(T0 + 0.05 + GRACE)
    assert await c.check_lease()
    # The install still running was stopped and nothing of it stays.
    assert c.status()["phase"] == "idle"
    assert p.admission_open
    assert p.restored == {}
    p.gate.set()
    await asyncio.sleep(0.01)
    assert p.restored == {}  # the cancelled install never completes later
    with pytest.raises(StaleCheckpoint):
        await c.handle("restore", restore_body(deadline=GRACE * 3))


async def test_a_lapse_after_an_unanswered_install_finished_frees_what_it_installed() -> None:
    c, p, clock = make()
    await miss_the_deadline(c, p)
    p.gate.set()  # type: ignore[union-attr]
    await asyncio.sleep(0.01)
    assert p.restored == {"r-a2": {"s": 1}}  # installed, but no call answered it
    clock.advance(GRACE + 1)
    assert await c.check_lease()
    assert p.restored == {}
    assert p.deleted == ["r-a2"]
    assert p.admission_open


async def test_a_lapse_after_an_answered_restore_keeps_the_state_for_its_owner() -> None:
    c, p, clock = make()
    assert await c.handle("restore", restore_body()) == RESTORED_REPLY
    clock.advance(30 + GRACE)
    assert await c.check_lease()
    # The coordinator saw the install: it retires or claims it, nothing is dropped.
    assert p.restored == {"r-a2": {"s": 1}}
    assert p.admission_open


async def test_a_retried_restore_waits_for_the_running_install_and_answers_it() -> None:
    c, p, _ = make()
    await miss_the_deadline(c, p)
    with pytest.raises(CheckpointConflict):
        await c.handle("restore", restore_body(deadline=30, checkpoint_dir="/other"))
    retry = asyncio.create_task(c.handle("restore", restore_body(deadline=30)))
    await asyncio.sleep(0.02)
    assert not retry.done()  # joins the install, does not refuse with invalid_phase
    p.gate.set()  # type: ignore[union-attr]
    assert await asyncio.wait_for(retry, 2) == RESTORED_REPLY
    assert p.installs == 1
    assert await c.handle("restore", restore_body(deadline=30)) == RESTORED_REPLY
    await c.handle("resume", body_t0("c0"))
    assert p.admission_open
    assert p.restored == {"r-a2": {"s": 1}}


async def test_a_cancelled_restore_call_keeps_admission_closed_until_the_install_ends() -> None:
    c, p, _ = make()
    p.gate = asyncio.Event()
    call = asyncio.create_task(c.handle("restore", restore_body()))
    await asyncio.wait_for(p.started.wait(), 2)
    call.cancel()  # the coordinator's fan-out gave up: ray.cancel
    with pytest.raises(asyncio.CancelledError):
        await call
    assert c.status()["phase"] == "restored"
    assert not p.admission_open
    p.gate.set()
    await asyncio.sleep(0.01)
    # Installed into a closed participant, never an idle open one.
    assert p.restored == {"r-a2": {"s": 1}}
    assert c.status()["phase"] == "restored"
    assert not p.admission_open
    # Then the normal rules: the retry answers the install; resume opens.
    assert await c.handle("restore", restore_body()) == RESTORED_REPLY
    assert p.installs == 1
    await c.handle("resume", body_t0("c0"))
    assert p.admission_open


async def test_a_cancelled_restore_then_a_lapse_drops_the_install() -> None:
    c, p, clock = make()
    p.gate = asyncio.Event()
    call = asyncio.create_task(c.handle("restore", restore_body()))
    await asyncio.wait_for(p.started.wait(), 2)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert c.status()["lease_expires_at"] == T0 + 30 + GRACE
    clock.advance(30 + GRACE)
    assert await c.check_lease()
    assert c.status()["phase"] == "idle"
    assert p.admission_open
    assert p.restored == {}


@pytest.mark.parametrize(
    "error", [TypeError("setstate() takes 2 arguments"), KeyError("rng"), RecursionError()]
)
async def test_an_untyped_install_error_is_invalid_state_and_installs_nothing(
    error: BaseException,
) -> None:
    c, p, _ = make()
    p.install_error = error
    with pytest.raises(InvalidCheckpointState) as info:
        await c.handle("restore", restore_body())
    assert info.value.reason is Reason.INVALID_CHECKPOINT_STATE
    assert info.value.http_status == 422
    assert not info.value.retryable
    assert type(error).__name__ in info.value.detail
    assert p.restored == {}  # the half it installed was freed
    assert c.status()["phase"] == "idle"
    assert p.admission_open
    # The ID was not consumed: a fixed participant restores with it.
    p.install_error = None
    assert await c.handle("restore", restore_body()) == RESTORED_REPLY


async def test_over_http_an_untyped_install_error_is_a_422_not_a_5xx(
    serve: Serve, http: aiohttp.ClientSession
) -> None:
    c, p, _ = make()
    c.clock = ManualClock(time.time())  # the routes check deadlines against wall time
    p.install_error = TypeError("__setstate__() missing 1 required positional argument")
    base = await serve(control_app(c, token="tok"))
    restore = {**restore_body(), "deadline_ts": time.time() + 30}
    async with http.post(
        f"{base}{CHECKPOINT_ROUTE_PREFIX}/restore",
        json=restore,
        headers={"Authorization": "Bearer tok"},
    ) as resp:
        status, reply = resp.status, await resp.json()
    assert status == 422
    assert reply["error"]["code"] == "invalid_checkpoint_state"
    assert "TypeError" in reply["error"]["detail"]
    assert p.restored == {}
    assert p.admission_open


async def test_an_install_that_fails_after_its_call_gave_up_is_answered_on_retry() -> None:
    c, p, _ = make()
    p.install_error = ValueError("bad rng state")
    await miss_the_deadline(c, p)
    p.gate.set()  # type: ignore[union-attr]
    await asyncio.sleep(0.01)
    assert c.status()["phase"] == "restored"  # no one has answered it yet
    assert not p.admission_open
    with pytest.raises(InvalidCheckpointState, match="ValueError: bad rng state"):
        await c.handle("restore", restore_body(deadline=30))
    assert p.restored == {}
    assert c.status()["phase"] == "idle"
    assert p.admission_open


async def test_a_resume_after_a_failed_install_leaves_nothing_installed() -> None:
    c, p, _ = make()
    p.install_error = TypeError("nope")
    await miss_the_deadline(c, p)
    p.gate.set()  # type: ignore[union-attr]
    await c.handle("resume", body_t0("c0"))
    assert p.restored == {}
    assert p.admission_open


async def test_after_a_restore_older_attempts_are_stale_until_forget() -> None:
    c, _, _ = make()
    assert await c.handle("restore", restore_body()) == RESTORED_REPLY
    # Attempt 2 of r is installed: attempts 0 and 1 are over on this host.
    for attempt in (0, 1):
        with pytest.raises(StaleAttempt) as info:
            c.retired.check(EpisodeId("r", attempt))
        assert info.value.http_status == 409
    c.retired.check(EpisodeId("r", 2))
    c.retired.check(EpisodeId("q"))  # not in the restore scope: untouched
    await c.handle("resume", body_t0("c0"))
    with pytest.raises(StaleAttempt):
        c.retired.check(EpisodeId("r", 1))
    assert await c.handle("forget", body_t0("f1", rollout_ids=["r"])) == {"forgotten": ["r"]}
    c.retired.check(EpisodeId("r", 1))


async def test_a_failed_install_raises_no_marks() -> None:
    c, p, _ = make()
    p.install_error = TypeError("nope")
    with pytest.raises(InvalidCheckpointState):
        await c.handle("restore", restore_body())
    c.retired.check(EpisodeId("r", 1))
    assert c.status()["retired_rollouts"] == 0


async def test_a_resumed_restore_id_is_stale_before_anything_else() -> None:
    c, p, _ = make()
    await miss_the_deadline(c, p)
    p.gate.set()  # type: ignore[union-attr]
    await c.handle("resume", body_t0("c0"))  # the unanswered install is over
    with pytest.raises(StaleCheckpoint):
        await c.handle("restore", restore_body(checkpoint_dir="/other"))
    with pytest.raises(StaleCheckpoint):
        await c.handle("restore", restore_body())
