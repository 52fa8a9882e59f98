"""The command line against the reference fleet (model, agent, environment,
resources) on the shared cluster: what `status` shows in flight, a
checkpoint without a scope refused before anyone pauses, a failed attempt
that does not block the retry, one size and one episode count everywhere,
and a restore into the live fleet refused naming its members."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from click.testing import CliRunner

from coordination.demo.app import main
from participants.fleet import FleetConfig, launch_fleet
from participants.rollout import make_tasks

pytestmark = pytest.mark.ray


def run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "240"})


def body(result: Any) -> Any:
    return json.loads(result.stdout)


async def _status_until(ns: list[str], ready: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        st = body(run("status", *ns, "--json"))
        if ready(st) or time.monotonic() > deadline:
            return dict(st)
        await asyncio.sleep(0.2)  # the driver's call goes on meanwhile


async def test_the_reference_fleet_from_the_shell(namespace: str, tmp_path: Path) -> None:
    import ray

    from coordination.actor.actor_options import COORDINATOR_NAME

    ns = ["--namespace", namespace]
    fleet = await launch_fleet(
        FleetConfig(namespace=namespace, token="cli-fleet", step_delay_s=0.2, token_delay_s=0.02)
    )
    call: asyncio.Task[Any] | None = None
    try:
        # The first command that needs it creates the coordinator (status never does).
        assert run("status", *ns, "--json").exit_code == 3
        assert run("collect", *ns, "--json").exit_code == 0
        task = make_tasks(1, 40, seed=3)[0]
        episode = {"episode_id": {"rollout_id": "fl-r1", "attempt": 0}, "task": task}
        async with aiohttp.ClientSession() as http:
            call = asyncio.ensure_future(
                http.post(f"{fleet.urls['environment']}/run", json=episode)
            )

            # status: the capture keys in flight, per participant, and who needs a scope.
            def in_flight(st: dict[str, Any]) -> bool:
                return any("fl-r1" in (p["live_keys"] or []) for p in st["participants"])

            st = await _status_until(ns, in_flight)
            by_kind = {p["kind"]: p for p in st["participants"]}
            assert "fl-r1" in by_kind["environment"]["live_keys"]
            assert by_kind["model"]["needs_scope"] is True
            assert by_kind["environment"]["needs_scope"] is False
            assert st["scope_source"] is False
            table = run("status", *ns)
            assert table.exit_code == 0
            assert "in flight" in table.stdout and "fl-r1" in table.stdout

            # No --scope, nothing to name one: refused before anyone pauses.
            target = tmp_path / "ckpt"
            refused = run("checkpoint", str(target), *ns)
            assert refused.exit_code == 2, refused.output
            line = refused.stderr.strip()
            assert "\n" not in line
            assert "model/" in line and "--scope fl-r1" in line
            st = body(run("status", *ns, "--json"))
            assert st["open_checkpoint"] is None
            assert {p["phase"] for p in st["participants"]} == {"idle"}
            assert st["last_checkpoint"] is None  # nothing was even tried
            assert not (target / "gym" / "_manifest.json").exists()

            # A failed attempt into the directory, then the retry there succeeds.
            strict = run(
                "checkpoint", str(target), *ns, "--scope", "fl-r1", "--scope", "ghost",
                "--strict", "--json",
            )  # fmt: skip
            assert strict.exit_code == 4, strict.output
            assert body(strict)["error"]["code"] == "restart_in_scope"
            done = run("checkpoint", str(target), *ns, "--scope", "fl-r1", "--json")
            assert done.exit_code == 0, done.output
            ck = body(done)
            assert ck["continued"] == ["fl-r1"]

            # One size and one episode count: checkpoint, inspect, list, status.
            inspected = body(run("inspect", str(target), "--json"))
            listed = {e["name"]: e for e in body(run("list", str(tmp_path), "--json"))}["ckpt"]
            last = body(run("status", *ns, "--json"))["last_checkpoint"]
            assert ck["total_bytes"] > 0
            assert inspected["bytes"] == listed["bytes"] == last["bytes"] == ck["total_bytes"]
            assert inspected["episodes"] == listed["episodes"] == last["episodes"] == 1
            assert listed["stored_bytes"] > listed["bytes"]  # the manifests too
            text = run("inspect", str(target)).stdout
            assert "1 episodes" in text
            for row in run("list", str(tmp_path)).stdout.splitlines():
                if " ckpt " in row:
                    assert row.count(text.strip().rsplit(", ", 1)[-1]) == 1  # same "x KiB"

            # A restore into the live fleet: refused, naming the members, nothing changed.
            live = run("restore", str(target), *ns, "--json")
            assert live.exit_code == 4, live.output
            error = body(live)["error"]
            assert error["code"] == "not_fresh"
            assert "environment/" in error["detail"] and "model/" in error["detail"]
            assert "environment/" in live.stderr and live.stderr.count("\n") == 1
            call.cancel()
            with contextlib.suppress(BaseException):
                await call
    finally:
        if call is not None:
            call.cancel()
        with contextlib.suppress(ValueError):  # the CLI's coordinator is detached
            ray.kill(ray.get_actor(COORDINATOR_NAME, namespace=namespace), no_restart=True)
        await fleet.stop()


async def test_restore_relaunch_starts_a_fresh_gym_from_the_shell(
    namespace: str, tmp_path: Path
) -> None:
    """`restore DIR --relaunch`: every registered host is replaced by a fresh
    one (new process, same node and URL), then the restore goes in; without
    it the same restore is refused as not fresh."""
    import ray

    from coordination.actor.actor_options import COORDINATOR_NAME

    ns = ["--namespace", namespace]
    config = FleetConfig(namespace=namespace, token="cli-relaunch", step_delay_s=0.2)
    fleet = await launch_fleet(config)
    names = [f"{kind}/{config.server_name(kind)}" for kind in fleet.urls]
    call: asyncio.Task[Any] | None = None
    try:
        assert run("collect", *ns, "--json").exit_code == 0  # creates the coordinator
        task = make_tasks(1, 40, seed=4)[0]
        episode = {"episode_id": {"rollout_id": "rl-r1", "attempt": 0}, "task": task}
        async with aiohttp.ClientSession() as http:
            call = asyncio.ensure_future(
                http.post(f"{fleet.urls['environment']}/run", json=episode)
            )

            def in_flight(st: dict[str, Any]) -> bool:
                return any("rl-r1" in (p["live_keys"] or []) for p in st["participants"])

            await _status_until(ns, in_flight)
            target = str(tmp_path / "ckpt")
            done = run("checkpoint", target, *ns, "--scope", "rl-r1", "--json")
            assert done.exit_code == 0, done.output
            call.cancel()
            with contextlib.suppress(BaseException):
                await call
        before = {n: (await ray.get_actor(n, namespace=namespace).ready.remote()) for n in names}
        assert run("restore", target, *ns, "--json").exit_code == 4  # a live fleet

        res = run("restore", target, *ns, "--relaunch", "--json")
        assert res.exit_code == 0, res.output
        out = body(res)
        assert out["relaunched"] == {n: before[n]["url"] for n in names}
        assert "rl-r1-a1" in out["restored"][f"environment/{config.server_name('environment')}"]
        for n in names:
            now = await ray.get_actor(n, namespace=namespace).ready.remote()
            assert now["pid"] != before[n]["pid"]  # a new process
            assert (now["url"], now["node_id"]) == (before[n]["url"], before[n]["node_id"])
        # The restored episode goes on in the relaunched Gym, URLs wired as before.
        async with aiohttp.ClientSession() as http:
            nxt = {"episode_id": {"rollout_id": "rl-r1", "attempt": 1}, "task": task}
            async with http.post(f"{fleet.urls['environment']}/run", json=nxt) as resp:
                assert resp.status == 200, await resp.text()
                assert "result" in await resp.json()
    finally:
        if call is not None:
            call.cancel()
        for n in [*names, COORDINATOR_NAME]:  # the relaunched hosts are detached
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(n, namespace=namespace), no_restart=True)
        with contextlib.suppress(Exception):
            await fleet.stop(timeout_s=5)


def test_a_real_process_attaches_quietly_and_creates_nothing(namespace: str) -> None:
    """`ray-ckpt status` in its own process against the running cluster: Ray's
    connect messages stay quiet, and with no coordinator the one line says
    so (exit 3) and none is created."""
    import os
    import subprocess
    import sys

    import ray

    from coordination.actor.actor_options import COORDINATOR_NAME

    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    out = subprocess.run(
        [sys.executable, "-c", "from coordination.demo.app import main; main()"]
        + ["status", "--address", address, "--namespace", namespace],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert out.returncode == 3, out.stderr[-3000:]
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"error (not found): no coordinator in namespace '{namespace}'")
    with pytest.raises(ValueError, match="Failed to look up actor"):
        ray.get_actor(COORDINATOR_NAME, namespace=namespace)
