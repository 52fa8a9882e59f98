"""The ray-ckpt command line against the shared cluster (in-process CliRunner)."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from click.testing import CliRunner
from pydantic import SecretStr

from coordination.cli import main
from ray_ckpt.hosting.host import start_host, stop_host
from ray_ckpt.hosting.spec import ServerSpec, settings_dict
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


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


async def test_status_checkpoint_inspect_restore_retire(namespace: str, tmp_path: Path) -> None:
    import ray

    ns = ["--namespace", namespace]
    host = start_host(SPEC, namespace=namespace)
    fresh = None
    try:
        url = (await host.ready.remote())["url"]
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
        code, out = run("inspect", ckpt, "--json")
        assert code == 0 and json.loads(out)["ok"] is True

        # Per episode of the scope: continued or restarted; --strict refuses the latter.
        scoped = ["--scope", "e1", "--scope", "ghost"]
        code, out = run("checkpoint", str(tmp_path / "scoped"), *scoped, *ns)
        assert code == 0, out
        assert "1 episodes continue, 1 start over (ghost)" in out
        strict = tmp_path / "strict"
        code, out = run("checkpoint", str(strict), *scoped, "--strict", *ns, "--json")
        assert code == 1
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

        # Bad input: a typed error, exit 1, nothing changed.
        code, out = run("restore", str(tmp_path / "nothing-here"), *ns, "--json")
        assert code == 1
        assert json.loads(out)["error"]["code"] == "invalid_checkpoint_state"
        code, out = run("status", *ns, "--json")
        assert json.loads(out)["participants"][0]["phase"] == "idle"
    finally:
        from coordination.coordinator import COORDINATOR_NAME

        # Each CLI call is its own connect(): the coordinator it made may already
        # be gone with its last handle (it is not detached).
        try:
            ray.kill(ray.get_actor(COORDINATOR_NAME, namespace=namespace), no_restart=True)
        except ValueError:
            pass
        for h in (host, fresh):
            if h is not None:
                await stop_host(h, timeout_s=5)
