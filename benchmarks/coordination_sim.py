"""The coordinator's own cost per participant, past what this machine can host.

A real `CoordinatorCore` (membership, ordered groups, fan-out, reply
checks, journal, the Gym manifest's encoding) drives N in-process fake hosts
(`coordination.reach.hosts.FakeHost`, the host wrapper interface the Ray and HTTP
hosts implement) that answer each control call at once with a canned, valid
reply.  A full cycle is prepare (four groups) -> commit -> Gym manifest ->
resume (four groups).  The fake hosts' own cost is measured on its own in
the same run (the same N x 9 calls, no coordinator) and subtracted, so
`coordinator_us_per_participant` = (cycle - hosts) / N is the coordinator's
CPU alone: everything runs on one thread, so wall time is CPU time here.
"""

from __future__ import annotations

import asyncio
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgspec

from coordination.engine.coordinator_core import CoordinatorCore
from coordination.engine.journal import Journal
from coordination.engine.order import Member
from coordination.engine.results import Timeouts
from coordination.reach.hosts import FakeHost

KINDS = ("environment", "model", "agent", "resources")
# Every reply a participant with nothing in flight gives (the shapes our
# `ParticipantEngine` answers with; the commit's manifest is filled in).
_PREPARED = {
    "phase": "prepared",
    "report": {
        "ready": True,
        "blockers": [],
        "blocker_count": 0,
        "counts": {"live": 0},
        "restarts": [],
        "blocker_details": [],
    },
}
_RESUMED = {"phase": "idle", "idempotent": False}


def canned(member: Member) -> Callable[[str, dict[str, Any]], dict[str, Any]]:
    def reply(op: str, body: dict[str, Any]) -> dict[str, Any]:
        if op == "prepare":
            return copy.deepcopy(_PREPARED)
        if op == "commit":
            manifest = {
                "checkpoint_id": body["checkpoint_id"],
                "kind": member.kind,
                "instance": member.name,
                "record_count": 0,
            }
            return {"phase": "committed", "manifest": manifest, "episode_ids": []}
        if op == "resume":
            return dict(_RESUMED)
        return {}

    return reply


def _encode_only(_dir: str, checkpoint_id: str, manifests: list[dict[str, Any]]) -> None:
    # The coordinator's share of the Gym manifest: building and encoding it
    # (the write itself is storage, measured by benchmarks/storage.py).
    msgspec.json.encode({"checkpoint_id": checkpoint_id, "participants": manifests})


def _hosts(n: int) -> list[FakeHost]:
    hosts = []
    for i in range(n):
        member = Member(KINDS[i % len(KINDS)], f"sim-{i}")
        hosts.append(FakeHost(member, reply=canned(member)))
    return hosts


def _reset(hosts: list[FakeHost]) -> None:
    for h in hosts:  # the fakes keep every call; drop them between cycles
        h.calls.clear()
        h.log.clear()


async def _hosts_alone(hosts: list[FakeHost]) -> float:
    """The fake hosts' own cost: a cycle's calls (each host's prepare, commit
    and resume), no coordinator."""
    body = {"checkpoint_id": "ckpt-sim", "deadline_ts": time.time() + 60}
    start = time.perf_counter()
    for op in ("prepare", "commit", "resume"):
        await asyncio.gather(*(h.call(op, body) for h in hosts))
    return time.perf_counter() - start


async def measure(n: int, reps: int, progress: Callable[[str], None]) -> dict[str, float | int]:
    hosts = _hosts(n)
    timeouts = Timeouts(renew_every_s=3600.0, reply_grace_s=0.5)
    core = CoordinatorCore(
        journal=Journal(None),
        timeouts=timeouts,
        manifest_writer=_encode_only,
        latest_writer=None,  # no pointer: nothing on disk
        manifest_reader=lambda d: (None, set()),
    )
    for h in hosts:
        core.register(h)
    try:
        await core.checkpoint("/sim/warm", [], resume=True)
        cycles, alone = [], []
        for rep in range(reps):  # interleaved, so drift hits both alike
            _reset(hosts)
            start = time.perf_counter()
            result = await core.checkpoint(f"/sim/c{rep}", [], resume=True)
            cycles.append(time.perf_counter() - start)
            assert len(result.episode_ids) == n, "every fake host committed"
            _reset(hosts)
            alone.append(await _hosts_alone(hosts))
            progress(f"simulated N={n} rep {rep + 1}/{reps}: cycle {cycles[-1] * 1e3:.1f} ms")
    finally:
        await core.aclose()
    cycle_s, hosts_s = statistics.median(cycles), statistics.median(alone)
    return {
        "participants": n,
        "cycle_s": cycle_s,
        "hosts_s": hosts_s,
        "coordinator_us_per_participant": max(cycle_s - hosts_s, 0.0) / n * 1e6,
    }


def run(
    sizes: list[int], reps: int, progress: Callable[[str], None]
) -> list[dict[str, float | int]]:
    return [asyncio.run(measure(n, reps, progress)) for n in sizes]
