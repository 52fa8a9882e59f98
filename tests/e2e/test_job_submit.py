"""`ray job submit` of the main job to a `ray start --head` cluster this test owns.

The head runs as `ray start --head --block` in its own process group, with
its own temp dir and explicit loopback ports, so it never touches the test
session's shared cluster; it is stopped by signalling that group (never
`ray stop`, which would end every Ray process on the machine), and the test
checks every process of it is gone.  Token auth (`RAY_AUTH_MODE=token`) is
exported for both the head and the CLI, so the client finds the token.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import psutil
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PORT_FLAGS = (
    "--port",
    "--dashboard-port",
    "--ray-client-server-port",
    "--node-manager-port",
    "--object-manager-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
)


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ray_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # every port on 127.0.0.1
        RAY_USAGE_STATS_ENABLED="0",
    )
    return env


def members(head: subprocess.Popen[bytes], pgid: int) -> set[psutil.Process]:
    """Every live process of the head: its process group and its descendants."""
    found: set[psutil.Process] = set()
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(proc.pid) == pgid:
                found.add(proc)
    with contextlib.suppress(psutil.Error):
        found.update(psutil.Process(head.pid).children(recursive=True))
    return found


def alive(procs: set[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid}:{p.name()}")
    return out


def wait_dashboard(url: str, head: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert head.poll() is None, f"ray start exited with {head.returncode}"
        try:
            urllib.request.urlopen(url + "/api/version", timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # it answered (401 without a token): it is up
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"the dashboard at {url} did not come up in {timeout_s}s")


@contextlib.contextmanager
def head_cluster(log: Path) -> Iterator[str]:
    """Start a head node; yield its dashboard address; stop every process of it."""
    tmp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Unix socket paths
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
    cmd = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--num-cpus=2",
        f"--temp-dir={tmp}",
        "--dashboard-host=127.0.0.1",
        "--include-dashboard=true",
        "--disable-usage-stats",
        *(f"{flag}={port}" for flag, port in ports.items()),
    ]
    with log.open("wb") as out:
        head = subprocess.Popen(
            cmd, env=ray_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    pgid = head.pid  # a new session: the head leads its own process group
    seen: set[psutil.Process] = set()
    try:
        url = f"http://127.0.0.1:{ports['--dashboard-port']}"
        wait_dashboard(url, head, 90)
        seen = members(head, pgid)
        yield url
    finally:
        seen |= members(head, pgid)
        # SIGTERM to `ray start --block` alone: it drains the node and stops
        # every process it started (signalling the whole group at once leaves
        # it waiting on children that died first).
        with contextlib.suppress(ProcessLookupError):
            os.kill(head.pid, signal.SIGTERM)
        end = time.monotonic() + 20
        while (head.poll() is None or alive(seen)) and time.monotonic() < end:
            time.sleep(0.2)
        leftover = seen | members(head, pgid)
        for proc in leftover:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=10)
        psutil.wait_procs(list(leftover), timeout=10)
        assert not alive(leftover | members(head, pgid)), "processes of the head outlived it"
        shutil.rmtree(tmp, ignore_errors=True)


def last_json(text: str) -> dict[str, object]:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            value = orjson.loads(line)
            assert isinstance(value, dict)
            return value
    raise AssertionError(f"no JSON line in the job's output:\n{text[-3000:]}")


def test_ray_job_submit_runs_the_main_job_on_a_head_cluster(tmp_path: Path) -> None:
    with head_cluster(tmp_path / "head.log") as url:
        job = f"ray-ckpt-e2e-{uuid.uuid4().hex[:8]}"
        submit = subprocess.run(
            [
                str(BIN / "ray"),
                "job",
                "submit",
                f"--address={url}",
                f"--submission-id={job}",
                "--",
                sys.executable,
                "-m",
                "coordination.demo",
                "--address",
                "auto",
                "--rollouts",
                "2",
                "--steps",
                "2",
                "--json",
            ],
            env=ray_env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
        status = subprocess.run(
            [str(BIN / "ray"), "job", "status", f"--address={url}", job],
            env=ray_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert f"Job '{job}' succeeded" in status.stdout, status.stdout + status.stderr
    # `ray job submit` tails the job's output: its last JSON line is the summary.
    summary = last_json(submit.stdout)
    assert summary["equal"] is True, summary
    assert summary["rollouts"] == 2
    required = {"episodes_continued", "episodes_restarted", "checkpoint_s", "restore_s", "bytes"}
    assert required <= set(summary), summary
