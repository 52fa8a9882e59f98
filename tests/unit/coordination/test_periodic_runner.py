"""The periodic loop without Ray: a manual clock, a sleep that advances it."""

from __future__ import annotations

import asyncio
import math

import pytest

from coordination.engine.results import CheckpointResult
from coordination.triggers.periodic import PeriodicRunner, checkpoint_name, episode_list
from ray_ckpt.clock import ManualClock
from ray_ckpt.errors import CheckpointConflict, CoordinationFailed, InvalidRequest
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.root.retention import GcPlan, PlanRow

T0 = 1_780_000_000.0


def result(where: str, n: int) -> CheckpointResult:
    return CheckpointResult(
        checkpoint_id=f"ckpt-{n}",
        checkpoint_dir=where,
        total_s=0.0,
        prepare_s=0.0,
        commit_s=0.0,
        manifest_s=0.0,
        resume_s=0.0,
        timings={},
        bytes={},
        total_bytes=0,
        episode_ids={},
        restarts={},
    )


class Harness:
    def __init__(self, *, every_s: float = 10.0, took_s: float = 1.0) -> None:
        self.clock = ManualClock(T0)
        self.took_s = took_s
        self.calls: list[tuple[float, str, str]] = []
        self.fail: set[int] = set()
        self.retain_fails = False
        self.retained: list[tuple[str, int]] = []
        self.gate: asyncio.Event | None = None
        self.called = asyncio.Event()
        self.runner = PeriodicRunner(self.checkpoint, self.retain, self.clock, self.sleep)

    async def sleep(self, seconds: float) -> None:
        self.clock.advance(seconds)
        await asyncio.sleep(0)

    async def checkpoint(self, root: str, where: str) -> CheckpointResult:
        self.calls.append((self.clock.now(), root, where))
        self.called.set()
        n = len(self.calls)
        if self.gate is not None:
            await self.gate.wait()
        self.clock.advance(self.took_s)
        if n in self.fail:
            raise CoordinationFailed(
                f"commit {n} failed",
                operation="commit",
                failures={"agent/a": {"code": "participant_unavailable", "detail": "disk"}},
            )
        return result(where, n)

    async def retain(self, root: str, keep: int) -> GcPlan:
        self.retained.append((root, keep))
        if self.retain_fails:
            raise OSError("bucket gone")
        row = PlanRow(name="old", action="delete", reason="", keys=1, bytes=1)
        return GcPlan(
            location=root, keep=keep, grace_s=0, dry_run=False, rows=[row], delete=[], bytes=1
        )

    async def until(self, calls: int) -> None:
        async with asyncio.timeout(5):
            while len(self.calls) < calls:
                self.called.clear()
                await self.called.wait()


async def test_it_runs_on_time_reports_a_failure_and_goes_on() -> None:
    h = Harness()
    h.fail = {2}
    started = h.runner.start("/ckpt", every_s=10, keep_latest_k=2)
    assert started.running
    assert started.next_at == T0 + 10
    await h.until(4)
    final = await h.runner.stop()
    assert final is not None
    assert [c[0] for c in h.calls[:4]] == [T0 + 10, T0 + 20, T0 + 30, T0 + 40]
    names = [c[2].rpartition("/")[2] for c in h.calls]
    assert names == sorted(names)
    assert len(set(names)) == len(names)
    assert all(c[1] == "/ckpt" and c[2].startswith("/ckpt/ckpt-") for c in h.calls)
    assert not final.running
    assert final.attempts == len(h.calls)
    assert final.failed == 1
    assert final.completed == final.attempts - 1
    assert final.consecutive_failures == 0
    assert final.last_error is not None
    assert final.last_error["code"] == "coordination_failed"
    assert final.last_error["name"] == names[1]
    assert final.last_error["failures"]["agent/a"]["detail"] == "disk"
    # Retention after each complete checkpoint only.
    assert h.retained == [("/ckpt", 2)] * final.completed
    assert final.deleted == final.completed


async def test_an_overrun_skips_the_missed_ticks() -> None:
    h = Harness(took_s=25.0)
    h.runner.start("/ckpt", every_s=10)
    await h.until(3)
    await h.runner.stop()
    # Each takes 25 s: the next one starts a full period after the overrun ends.
    assert [c[0] for c in h.calls[:3]] == [T0 + 10, T0 + 45, T0 + 80]
    assert h.retained == []  # no keep_latest_k: no retention


async def test_one_loop_at_a_time() -> None:
    h = Harness()
    h.runner.start("/ckpt", every_s=10, keep_latest_k=3)
    again = h.runner.start("/ckpt", every_s=10, keep_latest_k=3)
    assert again.root == "/ckpt"
    for kwargs in ({"every_s": 5.0, "keep_latest_k": 3}, {"every_s": 10, "keep_latest_k": 1}):
        with pytest.raises(CheckpointConflict, match="already runs under '/ckpt'"):
            h.runner.start("/ckpt", **kwargs)
    with pytest.raises(CheckpointConflict):
        h.runner.start("/other", every_s=10, keep_latest_k=3)
    await h.runner.stop()
    restarted = h.runner.start("/other", every_s=10)
    assert (restarted.root, restarted.attempts) == ("/other", 0)
    await h.runner.stop()
    assert await h.runner.stop() is not None  # idempotent


async def test_stop_lets_the_checkpoint_in_flight_finish() -> None:
    h = Harness()
    h.gate = asyncio.Event()
    h.runner.start("/ckpt", every_s=10)
    await h.until(1)
    stopping = asyncio.ensure_future(h.runner.stop())
    await asyncio.sleep(0.05)
    assert not stopping.done()
    h.gate.set()
    final = await stopping
    assert final is not None
    assert (final.completed, final.running, final.next_at) == (1, False, None)
    assert len(h.calls) == 1


async def test_a_failed_retention_is_reported_and_the_loop_goes_on() -> None:
    h = Harness()
    h.retain_fails = True
    h.runner.start("/ckpt", every_s=10, keep_latest_k=1)
    await h.until(3)
    final = await h.runner.stop()
    assert final is not None
    assert final.failed == 0
    assert final.deleted == 0
    assert final.last_retention_error is not None
    assert "bucket gone" in final.last_retention_error["detail"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"every_s": 0},
        {"every_s": -1},
        {"every_s": math.nan},
        {"every_s": math.inf},
        {"every_s": "10"},
        {"every_s": True},
        {"every_s": 10, "keep_latest_k": 0},
        {"every_s": 10, "keep_latest_k": 1.5},
        {"every_s": 10, "prefix": "a/b"},
        {"every_s": 10, "prefix": "../x"},
    ],
)
async def test_bad_settings_are_refused_and_start_nothing(kwargs: dict[str, object]) -> None:
    h = Harness()
    with pytest.raises(InvalidRequest):
        h.runner.start("/ckpt", **kwargs)  # type: ignore[arg-type]
    assert h.runner.status() is None


def test_names_sort_by_time_to_the_millisecond() -> None:
    assert checkpoint_name("ckpt-", 1_780_000_000.25) == "ckpt-20260528T202640250Z"
    stamps = [checkpoint_name("", T0 + d) for d in (0, 0.001, 0.999, 1, 86_400 * 400)]
    assert stamps == sorted(stamps)
    assert len(set(stamps)) == len(stamps)


async def test_names_stay_distinct_under_a_frozen_clock() -> None:
    h = Harness(took_s=0.0)

    async def no_time(seconds: float) -> None:
        await asyncio.sleep(0)

    h.runner = PeriodicRunner(h.checkpoint, h.retain, h.clock, no_time)
    h.runner.start("/ckpt", every_s=10)
    await h.until(3)
    await h.runner.stop()
    names = [c[2] for c in h.calls]
    assert names == sorted(names)
    assert len(set(names)) == len(names)


def test_episode_list_takes_every_episode_shape() -> None:
    got = episode_list(["r1", "r2-a3", ("r3", 1), {"rollout_id": "r4", "attempt": 2}])
    assert got == [EpisodeId("r1"), EpisodeId("r2", 3), EpisodeId("r3", 1), EpisodeId("r4", 2)]
    for bad in ("r1", [1], [("r", 1, 2)], None):
        with pytest.raises(InvalidRequest):
            episode_list(bad)  # type: ignore[arg-type]
