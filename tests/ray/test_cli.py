"""The ray-ckpt command line against the shared cluster (in-process CliRunner)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import aiohttp
import pytest
from click.testing import CliRunner
from pydantic import SecretStr

from coordination.cli.commands import main
from ray_ckpt.gym_server.spec import ServerSpec, settings_dict
from ray_ckpt.hosting.host import start_host, stop_host
from ray_ckpt.settings import CheckpointSettings

pytestmark = pytest.mark.ray

SPEC = ServerSpec(
    kind="environment",
    name="cli",
    factory="tests.servers:aiohttp_server",
    settings=settings_dict(
        CheckpointSettings(enabled=True, control_auth_token=SecretStr("cli-token"))
    ),
)


def run(*args: str, input_: str | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(
        main, list(args), input=input_, catch_exceptions=False, env={"COLUMNS": "200"}
    )
    # --json: stdout is one JSON object (an error's line goes to stderr).
    return result.exit_code, result.stdout if "--json" in args else result.output


async def test_status_checkpoint_inspect_restore_retire(namespace: str, tmp_path: Path) -> None:
    import ray

    ns = ["--namespace", namespace]
    # Looking creates nothing: no coordinator yet, status says so (exit 3).
    code, out = run("status", *ns, "--json")
    assert code == 3, out
    assert json.loads(out)["error"]["code"] == "not_found"
    from coordination.actor.actor_options import COORDINATOR_NAME

    with pytest.raises(ValueError, match="Failed to look up actor"):
        ray.get_actor(COORDINATOR_NAME, namespace=namespace)
    host = start_host(SPEC, namespace=namespace)
    fresh = None
    try:
        url = (await host.ready.remote())["url"]
        code, out = run("checkpoint", str(tmp_path / "first"), *ns, "--json")
        assert code == 0, out  # creates the coordinator that status then reads
        async with aiohttp.ClientSession() as http:
            async with http.put(f"{url}/episodes/e1", json={"next": "tool"}) as resp:
                assert resp.status == 200

        code, out = run("status", *ns, "--json")
        assert code == 0, out
        rows = json.loads(out)["participants"]
        assert [(r["participant"], r["phase"]) for r in rows] == [("environment/cli", "idle")]
        code, out = run("status", *ns)
        assert code == 0 and "environment/cli" in out and "no checkpoint open" in out

        ckpt = str(tmp_path / "ckpt")
        code, out = run("checkpoint", ckpt, *ns, "--json")
        assert code == 0, out
        assert json.loads(out)["episode_ids"] == {"environment/cli": ["e1"]}
        first = json.loads(out)
        # status: the last checkpoint, the kind, writes in flight and the lease.
        code, out = run("status", *ns, "--json")
        st = json.loads(out)
        assert st["last_checkpoint"]["checkpoint_id"] == first["checkpoint_id"]
        assert st["last_checkpoint"]["bytes"] == first["total_bytes"]
        assert st["last_checkpoint"]["trigger"] == "manual"
        assert st["participants"][0]["writes_in_flight"] == 0
        assert st["participants"][0]["kind"] == "environment"
        code, out = run("status", *ns)
        assert code == 0
        for header in ("kind", "lease", "writes"):  # rich may wrap a header cell
            assert header in out
        assert f"last checkpoint: {first['checkpoint_id']} (manual)" in out
        code, out = run("inspect", ckpt, "--json")
        assert code == 0 and json.loads(out)["ok"] is True

        # The checkpoint as a Chrome trace: one row per participant, its phases in order.
        trace_file = tmp_path / "timeline.json"
        code, out = run("timeline", "latest", "-o", str(trace_file), *ns, "--json")
        assert code == 0, out
        summary = json.loads(out)
        assert summary["rows"] == ["coordinator", "environment/cli"]
        assert (summary["op"], summary["outcome"]) == ("checkpoint", "ok")
        trace = json.loads(trace_file.read_text())
        slices = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 1]
        assert [n for n in slices if n in ("prepare", "commit", "resume")] == [
            "prepare",
            "commit",
            "resume",
        ]
        assert {"capture", "write", "release"} <= set(slices)
        code, out = run("timeline", "ckpt-unknown", "-o", str(tmp_path / "x.json"), *ns, "--json")
        assert code == 2
        assert json.loads(out)["error"]["code"] == "invalid_request"
        assert not (tmp_path / "x.json").exists()

        # --async: said when resumed, then when durable; the directory is complete.
        code, out = run("checkpoint", str(tmp_path / "async"), *ns, "--async")
        assert code == 0, out
        lines = out.strip().splitlines()
        assert lines[0].startswith("resumed after ")
        assert lines[-1].startswith("durable after ")
        code, out = run("checkpoint", str(tmp_path / "async2"), *ns, "--async", "--json")
        assert code == 0, out
        both = json.loads(out)
        assert both["checkpoint"]["pending"] is True
        assert both["durable"]["checkpoint_id"] == both["checkpoint"]["checkpoint_id"]
        assert both["resumed_s"] <= both["durable_s"]
        # Once durable, status says its size (not "size pending", not 0).
        code, out = run("status", *ns, "--json")
        last = json.loads(out)["last_checkpoint"]
        assert last["checkpoint_id"] == both["durable"]["checkpoint_id"]
        assert last["bytes"] == both["durable"]["total_bytes"] > 0
        code, out = run("inspect", str(tmp_path / "async2"), "--json")
        assert code == 0
        assert json.loads(out)["ok"] is True

        # Per episode of the scope: continued or restarted; --strict refuses the latter.
        scoped = ["--scope", "e1", "--scope", "ghost"]
        code, out = run("checkpoint", str(tmp_path / "scoped"), *scoped, *ns)
        assert code == 0, out
        assert "1 episodes continue, 1 start over (ghost)" in out
        strict = tmp_path / "strict"
        code, out = run("checkpoint", str(strict), *scoped, "--strict", *ns, "--json")
        assert code == 4
        error = json.loads(out)["error"]
        assert error["code"] == "restart_in_scope"
        assert "ghost" in error["detail"]
        assert not (strict / "gym" / "_manifest.json").exists()
        code, out = run("status", *ns, "--json")
        assert json.loads(out)["open_checkpoint"] is None
        assert json.loads(out)["participants"][0]["phase"] == "idle"

        ray.kill(host, no_restart=True)
        fresh = start_host(SPEC, namespace=namespace)
        await fresh.ready.remote()
        code, out = run("restore", ckpt, *ns, "--json")
        assert code == 0, out
        assert json.loads(out)["restored"] == {"environment/cli": ["e1-a1"]}

        code, out = run("retire", "e1", "1", *ns, "--json")
        assert code == 0, out
        assert json.loads(out)["retired"] == {"environment/cli": ["e1-a1"]}

        # Bad input: a typed error, exit 3 (not found), nothing changed.
        code, out = run("restore", str(tmp_path / "nothing-here"), *ns, "--json")
        assert code == 3
        assert json.loads(out)["error"]["code"] == "not_found"
        (tmp_path / "empty").mkdir()
        code, out = run("restore", str(tmp_path / "empty"), *ns, "--json")
        assert code == 3
        assert json.loads(out)["error"]["code"] == "invalid_checkpoint_state"
        code, out = run("status", *ns, "--json")
        assert json.loads(out)["participants"][0]["phase"] == "idle"
    finally:
        from coordination.actor.actor_options import COORDINATOR_NAME

        # The coordinator the CLI made is detached: it would outlive the session.
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(COORDINATOR_NAME, namespace=namespace), no_restart=True)
        for h in (host, fresh):
            if h is not None:
                await stop_host(h, timeout_s=5)


async def test_keep_open_then_resume_in_another_command_and_forget(
    namespace: str, tmp_path: Path
) -> None:
    """The coordinator a command creates is detached (it outlives the command),
    so `checkpoint --keep-open` and `resume` are two commands; `forget` frees
    a rollout ID; asking an existing coordinator for other options says so."""
    import ray

    from coordination.actor.actor_options import COORDINATOR_NAME
    from coordination.client.connect import connect

    ns = ["--namespace", namespace]
    host = start_host(SPEC, namespace=namespace)
    try:
        url = (await host.ready.remote())["url"]
        async with aiohttp.ClientSession() as http:
            async with http.put(f"{url}/episodes/e1", json={"next": "tool"}) as resp:
                assert resp.status == 200
        code, out = run("checkpoint", str(tmp_path / "open"), "--keep-open", *ns, "--json")
        assert code == 0, out
        cid = json.loads(out)["checkpoint_id"]
        actor = ray.get_actor(COORDINATOR_NAME, namespace=namespace)
        assert (await actor.creation_options.remote())["detached"] is True
        code, out = run("status", *ns, "--json")
        assert json.loads(out)["open_checkpoint"] == cid
        assert json.loads(out)["participants"][0]["phase"] == "committed"

        code, out = run("resume", *ns)
        assert code == 0, out
        assert f"resumed {cid}" in out
        code, out = run("status", *ns, "--json")
        assert json.loads(out)["open_checkpoint"] is None
        assert json.loads(out)["participants"][0]["phase"] == "idle"
        code, out = run("resume", *ns)
        assert code == 0
        assert "nothing to resume" in out

        code, out = run("retire", "e1", "0", *ns, "--json")
        assert code == 0, out
        code, out = run("forget", "e1", *ns, "--json")
        assert code == 0, out
        assert json.loads(out)["forgotten"] == {"environment/cli": ["e1"]}

        with pytest.warns(UserWarning, match=r"already exists with .*pause_mode='full'"):
            connect(namespace=namespace, pause_mode="barrier")
    finally:
        with contextlib.suppress(ValueError):  # detached: it would outlive the session
            ray.kill(ray.get_actor(COORDINATOR_NAME, namespace=namespace), no_restart=True)
        await stop_host(host, timeout_s=5)


async def test_collect_and_ack_hand_results_over_from_a_shell(
    namespace: str, tmp_path: Path
) -> None:
    """`collect --json` lists the held result, `ack` of that output frees it,
    a re-sent ack is idempotent and an unknown receipt changes nothing."""
    from participants.fleet import FleetConfig, launch_fleet
    from participants.rollout import make_tasks

    ns = ["--namespace", namespace]
    fleet = await launch_fleet(
        FleetConfig(namespace=namespace, token="cli-token", completion_receipts=True)
    )
    try:
        task = make_tasks(1, 1, seed=5)[0]
        body = {"episode_id": {"rollout_id": "cli-r1", "attempt": 0}, "task": task}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{fleet.urls['environment']}/run", json=body) as resp:
                reply = await resp.json()
        code, out = run("collect", *ns, "--json")
        assert code == 0, out
        held = json.loads(out)
        assert [r["receipt"] for r in held["results"]] == [reply["receipt"]]
        assert held["results"][0]["result"] == reply["result"]
        code, out = run("collect", *ns)
        assert code == 0 and "cli-r1" in out, out
        code, out = run("status", *ns, "--json")
        by_kind = {r["kind"]: r for r in json.loads(out)["participants"]}
        assert by_kind["environment"]["unacknowledged_results"] == 1

        stray = {**reply["receipt"], "digest": "0" * 64}
        code, out = run("ack", "-", *ns, "--json", input_=json.dumps([stray]))
        assert code == 3 and json.loads(out)["error"]["code"] == "unknown_receipt", out
        code, out = run("collect", *ns, "--json")
        assert len(json.loads(out)["results"]) == 1, "the refused ack freed nothing"

        saved = tmp_path / "held.json"
        saved.write_text(json.dumps(held))
        code, out = run("ack", str(saved), *ns)
        assert code == 0 and "acknowledged 1 results (0 already)" in out, out
        code, out = run("ack", str(saved), *ns)
        assert code == 0 and "acknowledged 0 results (1 already)" in out, out
        code, out = run("collect", *ns, "--json")
        assert json.loads(out)["results"] == []
        code, out = run("ack", "-", *ns, input_="not json")
        assert code == 2 and "not JSON" in out, out
    finally:
        await fleet.stop()
