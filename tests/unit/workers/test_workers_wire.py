"""Rollout ownership and the host <-> worker frames (pure parts and a real pipe)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest

from ray_ckpt.errors import InvalidRequest, StaleAttempt
from ray_ckpt.workers.channel import Channel, ChannelClosed
from ray_ckpt.workers.frames import FrameError, encode, read_frame
from ray_ckpt.workers.routing import owner_index, rollout_of_body, rollout_of_path


def test_owner_is_stable_across_processes_and_the_same_for_every_attempt() -> None:
    ids = [f"rollout-{i}" for i in range(64)]
    here = [owner_index(r, 3) for r in ids]
    # Another interpreter (another hash seed) agrees: no salted hash().
    code = (
        "from ray_ckpt.workers.routing import owner_index;"
        "print([owner_index(f'rollout-{i}', 3) for i in range(64)])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    )
    assert out.stdout.strip() == str(here)
    assert set(here) == {0, 1, 2}  # spread, not all on one
    assert rollout_of_path("/ng-rollout/rollout-5-a3/step") == "rollout-5"
    assert rollout_of_path("/ng-rollout/rollout-5/x") == "rollout-5"
    assert rollout_of_path("/run") is None
    with pytest.raises(InvalidRequest):
        rollout_of_path("/ng-rollout/bad key/step")


def test_body_names_its_rollout_or_nothing() -> None:
    assert rollout_of_body(b'{"episode_id": {"rollout_id": "r7", "attempt": 2}}') == "r7"
    for raw in (b"", b"not json", b"[]", b'{"episode_id": {"rollout_id": 5}}', b'{"x": 1}'):
        assert rollout_of_body(raw) is None
    assert rollout_of_body(b'{"episode_id": {"rollout_id": "r-a1"}}') is None  # reserved


async def _pair() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, socket.socket]:
    a, b = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=a)
    return reader, writer, b


async def test_an_oversized_frame_is_refused_before_its_body_is_read() -> None:
    reader, writer, raw = await _pair()
    raw.sendall((10_000).to_bytes(4, "big"))
    with pytest.raises(FrameError, match="10000-byte frame"):
        await read_frame(reader, max_bytes=1000)
    with pytest.raises(FrameError):
        encode({"x": b"y" * 2000}, max_bytes=1000)
    writer.close()
    raw.close()


async def test_calls_both_ways_typed_errors_and_a_dead_peer_fails_pending_calls() -> None:
    a, b = socket.socketpair()
    ra, wa = await asyncio.open_connection(sock=a)
    rb, wb = await asyncio.open_connection(sock=b)
    seen: list[tuple[str, object]] = []
    hang = asyncio.Event()

    async def serve_b(op: str, body: dict[str, object]) -> object:
        if op == "stale":
            raise StaleAttempt("retired")
        if op == "hang":
            await hang.wait()
        return {"echo": body, "bytes": b"\x00\xff"}

    async def serve_a(op: str, body: dict[str, object]) -> object:
        return op

    side_a = Channel(ra, wa, handler=serve_a, on_message=lambda o, b: None, name="a")
    side_b = Channel(rb, wb, handler=serve_b, on_message=lambda o, b: seen.append((o, b)), name="b")
    side_a.start()
    side_b.start()
    assert await side_a.call("x", {"k": 1}) == {"echo": {"k": 1}, "bytes": b"\x00\xff"}
    assert await side_b.call("back", {}) == "back"
    with pytest.raises(StaleAttempt):
        await side_a.call("stale", {})
    await side_a.send("report", {"ready": True})
    await asyncio.sleep(0.05)
    assert seen == [("report", {"ready": True})]
    pending = asyncio.ensure_future(side_a.call("hang", {}))
    await asyncio.sleep(0.05)
    await side_b.aclose()  # the peer dies mid-call
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(pending, 2.0)
    with pytest.raises(ChannelClosed):
        await side_a.call("x", {})
    await side_a.aclose()


def test_stats_of_all_workers_merge_into_one_servers() -> None:
    from ray_ckpt.workers.front import merge_stats

    merged = merge_stats(
        [
            {"kind": "agent", "calls": {"run": 2}, "live": 1, "ids": ["a"], "ok": True},
            {"kind": "agent", "calls": {"run": 3, "close": 1}, "live": 0, "ids": ["b"]},
        ]
    )
    assert merged == {
        "kind": "agent",
        "calls": {"run": 5, "close": 1},
        "live": 1,
        "ids": ["a", "b"],
        "ok": True,
    }
