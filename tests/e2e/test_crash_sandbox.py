"""A process-level crash of the coding environment: every episode's files and reward survive.

The reference coding environment runs as a `ParticipantHost` on the shared
cluster, its sandboxes under a root of the test's.  A checkpoint is taken
mid-flight and the host resumes; the episodes patch their projects on past
it; then the host's process is killed (SIGKILL: no drain, no stop, its
background process orphaned).  A fresh host takes the root over, restores
the checkpoint (every sandbox as it was at the checkpoint, not as the dead
process left it), and every unfinished episode runs on as attempt + 1.
Each episode's files and reward must equal an uninterrupted run's.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from coordination.demo.sandbox import (
    KIND,
    Outcome,
    coding_spec,
    launch_coding,
    sandbox_tasks,
    uninterrupted,
)
from coordination.demo.scenario import Rollouts, fleet_stats
from participants.fleet import FleetConfig
from participants.sandboxes import LIVE_PROCESS
from ray_ckpt.control.client import data_session
from tests.e2e.conftest import E2E, until

pytestmark = [pytest.mark.ray]


def processes_under(root: Path) -> list[int]:
    """Pids of the processes whose working directory is under `root`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if cwd.startswith(str(root)):
            found.append(int(pid))
    return found


async def test_a_killed_coding_host_continues_every_episode_to_equal_files_and_reward(
    e2e: E2E,
) -> None:
    tasks = sandbox_tasks(4, steps=4, seed=23)
    config = FleetConfig(namespace=e2e.namespace, token="e2e-token")
    expected, _ = await uninterrupted(config, tasks, str(e2e.tmp / "baseline"), advance=_none)

    root = e2e.tmp / "sandboxes"
    spec = coding_spec(config, name="ref-coding", root=str(root), step_delay_s=0.12)
    fleet = await launch_coding(config, spec)
    e2e.fleets.append(fleet)
    gym = e2e.coordinator()
    gym.discover()
    rollouts = Rollouts(dict(tasks))
    e2e.drivers.append(rollouts)
    async with data_session(64, 64) as session:
        for i, rollout in enumerate(tasks):
            rollouts.start(session, fleet.urls[KIND], rollout, delay_s=0.1 * i)

        async def stats() -> dict[str, Any]:
            return (await fleet_stats(fleet))[KIND]

        # Mid-flight: r0's background process runs, the others are past setup.
        await until(
            lambda: _mid_flight(stats, set(tasks)), "the background process and every episode"
        )
        prepared = await gym.aprepare()
        assert [k for keys in prepared.restarts.values() for k in keys] == ["r0"]
        assert (await stats())["sandbox_restarts"] == {"r0": LIVE_PROCESS}
        scope = [e for e in rollouts.in_flight() if e.rollout_id != "r0"]
        committed = await gym.acommit(str(e2e.tmp / "ckpt"), scope)
        assert sorted(k for keys in committed.episode_ids.values() for k in keys) == sorted(
            e.capture_key for e in scope
        )
        at_checkpoint = (await stats())["steps"]
        await gym.aresume()
        # The episodes move on past the checkpoint: their live files change.
        await until(
            lambda: _steps_beyond(stats, at_checkpoint + 3), "three more steps after the resume"
        )

        os.kill(fleet.info[KIND]["pid"], signal.SIGKILL)
        await rollouts.abandon()
        unfinished = rollouts.unfinished()
        assert "r0" in {e.rollout_id for e in unfinished}  # the long one
        orphans = processes_under(root)
        assert orphans, "the dead host's background process runs on, orphaned"

        fresh = await launch_coding(config, spec)
        e2e.fleets.append(fresh)
        scoped = {e.rollout_id for e in scope}
        restore = [e for e in unfinished if e.rollout_id in scoped]
        restored = await gym.arestore(str(e2e.tmp / "ckpt"), restore)
        assert sorted(restored.continued) == sorted(e.capture_key for e in restore)
        # Taking the root over removed the dead process's sandboxes, and so
        # ended their background process.
        await until(
            lambda: _none_of(orphans), "the orphaned background process to end", timeout_s=10
        )
        for episode in unfinished:
            rollouts.start(session, fresh.urls[KIND], episode.rollout_id, attempt=1)
        await rollouts.wait(timeout_s=120)
        after = await stats_of(fresh)

    assert rollouts.failures == {}
    got = {r: Outcome.of(res) for r, res in rollouts.results.items()}
    assert got == expected
    assert len({o.reward for o in got.values()}) > 1  # rewards differ by seed
    # Only the restart made a sandbox of its own; the others went on in theirs.
    assert after["sandboxes_created"] == len(unfinished) - len(restore)
    assert after["sandboxes"] == 0
    assert processes_under(root) == []


async def _mid_flight(stats: Any, rollouts: set[str]) -> bool:
    s = await stats()
    progress = s.get("progress", {})
    begun = all(isinstance(progress.get(r), int) and progress[r] >= 2 for r in rollouts)
    return begun and "r0" in s.get("processes_live", [])


async def _steps_beyond(stats: Any, n: int) -> bool:
    return bool((await stats())["steps"] >= n)


async def _none_of(pids: list[int]) -> bool:
    return not any(_running(pid) for pid in pids)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow, or absent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


async def stats_of(fleet: Any) -> dict[str, Any]:
    return (await fleet_stats(fleet))[KIND]


def _none() -> None:
    return None
