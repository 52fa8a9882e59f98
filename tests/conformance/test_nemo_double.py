"""The NeMo Gym-shaped participant itself, over real HTTP: it must behave as the notes say.

These pass today and keep the double honest: if it did not fence, validate or
write manifests as NeMo Gym does, the conformance tests driving it would prove
nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.conformance.conftest import TOKEN, Serve
from tests.conformance.nemo_participant import PREFIX, EpisodeId


async def post(
    http: aiohttp.ClientSession,
    url: str,
    op: str,
    body: Any,
    *,
    token: str | None = TOKEN,
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(f"{url}{PREFIX}/{op}", data=data, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


def b(cid: str, ahead: float = 20.0, **extra: Any) -> dict[str, Any]:
    return {"checkpoint_id": cid, "deadline_ts": time.time() + ahead, **extra}


async def test_validation_is_fastapi_422_and_runs_before_the_token(
    serve_nemo: Serve, http: aiohttp.ClientSession
) -> None:
    s = await serve_nemo("model")
    # An extra field, no token: the body is judged first (422, not 401).
    status, reply = await post(http, s.url, "prepare", {**b("c1"), "x": 1}, token=None)
    assert status == 422
    assert set(reply) == {"detail"}
    assert reply["detail"][0]["type"] == "extra_forbidden"
    assert reply["detail"][0]["loc"] == ["body", "x"]
    for bad in (
        {"checkpoint_id": "c1\n", "deadline_ts": 1.0},  # pattern: no trailing newline
        {"checkpoint_id": "-c", "deadline_ts": 1.0},
        {"checkpoint_id": "c" * 129, "deadline_ts": 1.0},
        {"checkpoint_id": "c1"},
    ):
        status, reply = await post(http, s.url, "prepare", bad)
        assert status == 422, bad
        assert isinstance(reply["detail"], list), bad
    status, reply = await post(http, s.url, "prepare", b"NaN-ish{")
    assert status == 422
    status, reply = await post(http, s.url, "retire", b("c1", episode_ids=[]))
    assert status == 422  # at least one episode
    status, reply = await post(
        http, s.url, "retire", b("c1", episode_ids=[{"rollout_id": "r-a1", "attempt": 0}])
    )
    assert status == 422  # a rollout_id may not end in -a<N>
    # A valid body with a bad token: 401 in the error envelope.
    status, reply = await post(http, s.url, "prepare", b("c1"), token="wrong")
    assert status == 401
    assert reply["error"]["code"] == "unauthorized"
    async with http.get(f"{s.url}{PREFIX}/status") as resp:
        assert resp.status == 401
    assert s.participant.phase == "idle"
    assert s.participant.calls == []


async def test_fencing_phases_and_replay(serve_nemo: Serve, http: aiohttp.ClientSession) -> None:
    s = await serve_nemo("environment")
    status, first = await post(http, s.url, "prepare", b("c1"))
    assert (status, first["phase"]) == (200, "prepared")
    assert first["report"] == {
        "ready": True,
        "blockers": [],
        "blocker_count": 0,
        "counts": {"episodes": 0, "blocking": 0},
        "restarts": [],
    }
    assert (await post(http, s.url, "prepare", b("c1")))[1] == first  # replayed
    status, reply = await post(http, s.url, "prepare", b("c2"))
    assert (status, reply["error"]["code"]) == (409, "checkpoint_conflict")
    status, reply = await post(http, s.url, "restore", b("c1", checkpoint_dir="/x", episode_ids=[]))
    assert (status, reply["error"]["code"]) == (409, "invalid_phase")
    status, reply = await post(http, s.url, "retire", b("c1", episode_ids=[{"rollout_id": "r"}]))
    assert (status, reply["error"]["code"]) == (409, "invalid_phase")  # resume first
    status, reply = await post(http, s.url, "renew", b("c1", ahead=100))
    assert status == 200
    assert reply["lease_expires_at"] >= time.time() + 100 + 599
    assert (await post(http, s.url, "resume", b("c1")))[1] == {"phase": "idle", "idempotent": False}
    assert (await post(http, s.url, "resume", b("c1")))[1] == {"phase": "idle", "idempotent": True}
    for op in ("prepare", "renew"):
        status, reply = await post(http, s.url, op, b("c1"))
        assert (status, reply["error"]["code"]) == (409, "stale_checkpoint"), op
    # A never-seen ID while idle: idempotent, and remembered (a delayed prepare is stale).
    assert (await post(http, s.url, "resume", b("c9")))[1] == {"phase": "idle", "idempotent": True}
    assert (await post(http, s.url, "prepare", b("c9")))[1]["error"]["code"] == "stale_checkpoint"


async def test_string_blockers_deadline_bounds_only_the_wait_and_resume_interrupts(
    serve_nemo: Serve, http: aiohttp.ClientSession
) -> None:
    s = await serve_nemo("agent")
    s.participant.start("r1", 2, blocking=True)
    s.participant.start("r0", blocking=True)
    s.participant.start("r5", restart=True)
    status, reply = await post(http, s.url, "prepare", b("c1", ahead=-5))  # already past
    assert status == 200
    assert reply["phase"] == "preparing"
    assert reply["report"]["blockers"] == ["r0", "r1-a2"]
    assert reply["report"]["blocker_count"] == 2
    assert reply["report"]["restarts"] == ["r5"]
    assert not s.participant.admission_open  # stays closed
    await s.participant.unblock("r0")
    await s.participant.unblock("r1-a2")
    status, reply = await post(http, s.url, "prepare", b("c1", ahead=-5))
    assert (status, reply["phase"]) == (200, "prepared")  # ready: the past deadline is no bar
    await post(http, s.url, "resume", b("c1"))
    # A waiting prepare is interrupted by resume and answers idle.
    s.participant.start("r7", blocking=True)
    waiting = asyncio.create_task(post(http, s.url, "prepare", b("c2")))
    await asyncio.sleep(0.1)
    assert (await post(http, s.url, "resume", b("c2")))[1]["idempotent"] is False
    status, reply = await asyncio.wait_for(waiting, 5)
    assert reply["phase"] == "idle"


async def test_blockers_are_capped_at_100_with_the_full_count(
    serve_nemo: Serve, http: aiohttp.ClientSession
) -> None:
    s = await serve_nemo("environment")
    for i in range(130):
        s.participant.start(f"r{i:03d}", blocking=True)
    async with http.get(
        f"{s.url}{PREFIX}/status", headers={"Authorization": f"Bearer {TOKEN}"}
    ) as r:
        report = (await r.json())["report"]
    assert len(report["blockers"]) == 100
    assert report["blocker_count"] == 130
    assert all(isinstance(k, str) for k in report["blockers"])


async def test_manifest_fields_records_jsonl_manifest_last_and_immutable(
    serve_nemo: Serve, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    s = await serve_nemo("model", "policy")
    s.participant.start("r0", state={"z": 1, "a": float("nan")})
    s.participant.start("r1", 1, state={"step": 3})
    await post(http, s.url, "prepare", b("c1"))
    status, reply = await post(http, s.url, "commit", b("c1", checkpoint_dir=str(tmp_path)))
    assert status == 200
    assert reply["phase"] == "committed"
    assert reply["episode_ids"] == ["r0", "r1-a1"]
    m = reply["manifest"]
    assert set(m) == {
        "schema_version", "kind", "instance", "checkpoint_id",
        "records_file", "records_sha256", "record_count",
    }  # fmt: skip
    assert (m["kind"], m["instance"], m["checkpoint_id"], m["record_count"]) == (
        "model", "policy", "c1", 2,
    )  # fmt: skip
    where = tmp_path / "gym" / "model" / "policy"
    assert m["records_file"] == f"records-{m['records_sha256']}.jsonl"
    lines = (where / m["records_file"]).read_text().splitlines()
    assert (
        lines[0]
        == '{"episode_id": {"rollout_id": "r0", "attempt": 0}, "state": {"z": 1, "a": NaN}}'
    )
    assert json.loads((where / "manifest.json").read_text()) == m
    assert sorted(p.name for p in where.iterdir()) == ["manifest.json", m["records_file"]]
    assert not (tmp_path / "gym" / "_manifest.json").exists()  # no Gym manifest
    # A retry with another directory is answered from the cache.
    again = await post(http, s.url, "commit", b("c1", checkpoint_dir=str(tmp_path / "other")))
    assert again == (200, reply)
    await post(http, s.url, "resume", b("c1"))
    # Another commit into the same directory cannot replace the manifest.
    await post(http, s.url, "prepare", b("c2"))
    status, reply = await post(http, s.url, "commit", b("c2", checkpoint_dir=str(tmp_path)))
    assert (status, reply["error"]["code"]) == (422, "invalid_checkpoint_state")
    assert json.loads((where / "manifest.json").read_text()) == m


async def test_restore_needs_a_fresh_process_installs_attempt_plus_one_and_checks_digest(
    serve_nemo: Serve, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    old = await serve_nemo("resources", "res")
    old.participant.start("r0", state={"s": 1})
    old.participant.start("r1", state={"s": 2})
    await post(http, old.url, "prepare", b("c1"))
    await post(http, old.url, "commit", b("c1", checkpoint_dir=str(tmp_path)))
    scope = [{"rollout_id": "r0", "attempt": 0}]
    status, reply = await post(
        http, old.url, "restore", b("c1r", checkpoint_dir=str(tmp_path), episode_ids=scope)
    )
    assert (status, reply["error"]["code"]) == (409, "checkpoint_conflict")  # c1 still active
    await post(http, old.url, "resume", b("c1"))
    status, reply = await post(
        http, old.url, "restore", b("c1r", checkpoint_dir=str(tmp_path), episode_ids=scope)
    )
    assert (status, reply["error"]["code"]) == (409, "invalid_phase")  # served: not fresh
    new = await serve_nemo("resources", "res")
    status, reply = await post(
        http, new.url, "restore", b("c1r", checkpoint_dir=str(tmp_path), episode_ids=scope)
    )
    assert (status, reply) == (
        200, {"phase": "restored", "source_checkpoint_id": "c1", "restored": ["r0-a1"]},
    )  # fmt: skip
    assert new.participant.episodes["r0-a1"].state == {"s": 1}
    assert "r1-a1" not in new.participant.episodes  # only the scope is installed
    # Retire in the restored phase: the restore's ID, not another.
    bad = await post(http, new.url, "retire", b("zz", episode_ids=scope))
    assert bad[1]["error"]["code"] == "checkpoint_conflict"
    # Corrupt records: 422 and nothing installed.
    where = tmp_path / "gym" / "resources" / "res"
    records = next(where.glob("records-*.jsonl"))
    records.write_text(records.read_text().replace('"s": 2', '"s": 3'))
    fresh = await serve_nemo("resources", "res")
    status, reply = await post(
        http, fresh.url, "restore", b("c2r", checkpoint_dir=str(tmp_path), episode_ids=scope)
    )
    assert (status, reply["error"]["code"]) == (422, "invalid_checkpoint_state")
    assert "digest" in reply["error"]["detail"]
    assert fresh.participant.episodes == {}


async def test_retire_not_fenced_when_idle_marks_only_rise_forget_clears(
    serve_nemo: Serve, http: aiohttp.ClientSession
) -> None:
    s = await serve_nemo("environment")
    p = s.participant
    p.start("r", 0, blocking=True)
    await post(http, s.url, "prepare", b("c1", ahead=0.05))
    await post(http, s.url, "resume", b("c1"))
    # The straggler path: retire under the ID resumed moments ago is served.
    status, reply = await post(http, s.url, "retire", b("c1", episode_ids=[{"rollout_id": "r"}]))
    assert (status, reply) == (200, {"retired": ["r"]})
    assert "r" not in p.episodes
    p.start("r", 2)
    # A delayed retire of a lower attempt never lowers the mark or stops attempt 2.
    await post(http, s.url, "retire", b("x", episode_ids=[{"rollout_id": "r", "attempt": 1}]))
    assert p.marks == {"r": 1}
    assert "r-a2" in p.episodes
    err = None
    try:
        p.start("r", 1)
    except Exception as exc:
        err = getattr(exc, "code", None)
    assert err == "stale_attempt"
    status, reply = await post(http, s.url, "forget", b("forget", rollout_ids=["r", "q"]))
    assert (status, reply) == (200, {"forgotten": ["q", "r"]})
    assert p.marks == {}
    p.start("r", 1)  # allowed again after forget


async def test_lease_expiry_is_an_abort(serve_nemo: Serve, http: aiohttp.ClientSession) -> None:
    s = await serve_nemo("agent", lease_grace_seconds=0.2)
    await post(http, s.url, "prepare", b("c1", ahead=0.0))
    assert s.participant.phase == "prepared"
    await asyncio.sleep(0.6)
    assert s.participant.phase == "idle"
    assert s.participant.admission_open
    status, reply = await post(http, s.url, "commit", b("c1", checkpoint_dir="/tmp/x"))
    assert (status, reply["error"]["code"]) == (409, "stale_checkpoint")


def test_capture_keys_round_trip() -> None:
    for key, eid in (("r", ("r", 0)), ("r-a2", ("r", 2)), ("x-a0", ("x-a0", 0))):
        e = EpisodeId.from_capture_key(key)
        assert (e.rollout_id, e.attempt) == eid
        assert e.capture_key == key
