"""The two doubles against each other: NeMo Gym's controller patterns on NeMo Gym's participants.

This passes today and proves the doubles agree with each other and with the
notes: the full cycle (straggler, restart, commit, resume, restore in fresh
apps, retire, forget, a failed restore's cleanup) runs over real HTTP.  The
conformance tests then swap one side for ours.
"""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.conformance.conftest import KINDS, TOKEN, Serve, Served
from tests.conformance.nemo_controller import (
    FORGET_ID,
    RETIRE_ID,
    Controller,
    CoordinationError,
    checkpoint_dir,
    restore_id,
)


async def test_nemo_controller_full_cycle_on_nemo_participants(
    serve_nemo: Serve, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    fleet = {kind: await serve_nemo(kind) for kind in KINDS}
    judge = web.AppRunner(web.Application())  # no control routes: 404 on status
    await judge.setup()
    site = web.TCPSite(judge, "127.0.0.1", 0)
    await site.start()
    host, port = judge.addresses[0][:2]
    ctl = Controller(http, TOKEN)
    urls = {f"s-{k}": s.url for k, s in reversed(fleet.items())}
    members = await ctl.discover({**urls, "judge": f"http://{host}:{port}"})
    await judge.cleanup()
    assert [m.kind for m in members] == list(KINDS)  # sorted by stage; the judge left out
    parts = {k: s.participant for k, s in fleet.items()}
    for p in parts.values():
        p.start("r0", state={"kind": p.kind})
        p.start("r2", restart=p.kind == "resources")
    for p in parts.values():
        p.start("r1", blocking=p.kind == "agent")

    # A straggler: prepare stops at the agent stage, resources are never asked.
    result = await ctl.prepare(members, "ckpt-1", time.time() + 0.2)
    assert not result.prepared
    assert result.blockers() == {"s-agent": ["r1"]}
    assert [op for op, _ in parts["resources"].calls] == []
    await ctl.retire_stragglers(members, "ckpt-1", result, time.time() + 5)
    assert all(p.phase == "idle" and p.marks == {"r1": 0} for p in parts.values())
    for p in parts.values():  # resume, then retire under the SAME checkpoint ID
        ops = [(op, body["checkpoint_id"]) for op, body in p.calls]
        assert ops[-2:] == [("resume", "ckpt-1"), ("retire", "ckpt-1")], (p.kind, ops)
    for p in parts.values():
        p.start("r1", 1)  # re-run as attempt+1

    result = await ctl.prepare(members, "ckpt-2", time.time() + 5)
    assert result.prepared
    assert result.restarts() == {"r2"}
    in_flight = [{"rollout_id": "r0", "attempt": 0}, {"rollout_id": "r1", "attempt": 1},
                 {"rollout_id": "r2", "attempt": 0}]  # fmt: skip
    scope = result.continued(in_flight)
    assert [e["rollout_id"] for e in scope] == ["r0", "r1"]
    where = checkpoint_dir(tmp_path, "ckpt-2")
    commits = await ctl.commit(members, "ckpt-2", time.time() + 5, where, scope)
    assert {k: r["episode_ids"] for k, r in commits.items()} == {
        f"s-{k}": ["r0", "r1-a1"] for k in KINDS
    }
    assert await ctl.resume(members, "ckpt-2", time.time() + 5) == {}
    resumed_at = {k: p.seq[-1] for k, p in parts.items()}
    assert sorted(resumed_at, key=resumed_at.__getitem__) == list(reversed(KINDS))

    # Restore into fresh apps under a restore-<hex> ID.
    fresh = {kind: await serve_nemo(kind) for kind in KINDS}
    members = await ctl.discover({f"s-{k}": s.url for k, s in fresh.items()})
    rid = restore_id()
    replies = await ctl.restore(members, rid, time.time() + 5, where, scope)
    assert {tuple(r["restored"]) for r in replies.values()} == {("r0-a1", "r1-a2")}
    assert fresh["model"].participant.episodes["r0-a1"].state == {"kind": "model"}
    assert await ctl.resume(members, rid, time.time() + 5) == {}

    # The collection's constant IDs, repeated.
    for _ in range(2):
        await ctl.retire(members, RETIRE_ID, time.time() + 5, [{"rollout_id": "r2"}])
    assert all(s.participant.marks == {"r2": 0} for s in fresh.values())
    for _ in range(2):
        await ctl.forget(members, FORGET_ID, time.time() + 5, ["r2"])
    assert all(s.participant.status()["retired_rollouts"] == 0 for s in fresh.values())


async def test_failed_restore_retires_next_attempts_everywhere_then_resumes(
    serve_nemo: Serve, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    old = {kind: await serve_nemo(kind) for kind in KINDS}
    ctl = Controller(http, TOKEN)
    members = await ctl.discover({k: s.url for k, s in old.items()})
    for s in old.values():
        s.participant.start("r0")
    assert (await ctl.prepare(members, "c1", time.time() + 5)).prepared
    where = checkpoint_dir(tmp_path, "c1")
    await ctl.commit(members, "c1", time.time() + 5, where, [{"rollout_id": "r0"}])
    await ctl.resume(members, "c1", time.time() + 5)
    fresh: dict[str, Served] = {kind: await serve_nemo(kind) for kind in KINDS}
    fresh["agent"].participant.start("busy")  # served: restore refuses it
    members = await ctl.discover({k: s.url for k, s in fresh.items()})
    rid = restore_id()
    assert rid.startswith("restore-")
    with pytest.raises(CoordinationError) as info:
        await ctl.restore(members, rid, time.time() + 5, where, [{"rollout_id": "r0"}])
    assert set(info.value.failures) == {"agent"}
    for s in fresh.values():
        p = s.participant
        assert (p.phase, p.marks) == ("idle", {"r0": 1}), p.kind
        assert "r0-a1" not in p.episodes  # restored state freed
    calls = fresh["model"].participant.calls
    assert [op for op, _ in calls] == ["restore", "retire", "resume"]
    retire = calls[1][1]
    assert retire["checkpoint_id"] == rid
    assert retire["episode_ids"] == [{"rollout_id": "r0", "attempt": 1}]
    assert retire["deadline_ts"] >= time.time() + 25  # the cleanup gets at least 30 s
