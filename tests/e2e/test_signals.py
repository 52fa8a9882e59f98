"""Preemption as a user meets it: real signals to a real driver process.

`python -m coordination.demo --until-signal` runs on its own local Ray (2
nodes for the first run); the tests send SIGUSR1 and SIGTERM as Slurm,
Kubernetes or `ray job stop` would and then run `--resume latest` on a fresh
cluster over the same root:

1. SIGUSR1 checkpoints and the run goes on; SIGTERM checkpoints inside the
   budget with `stop` and the process exits 128+15; `LATEST` names it.
2. With a budget too short, SIGTERM's checkpoint fails whole: the process
   still exits, `LATEST` still names the previous checkpoint and the failed
   one holds no Gym manifest.
3. `--resume latest` (that previous checkpoint) continues every unfinished
   episode and equals an uninterrupted run; a SIGUSR1 there checkpoints,
   the run finishes and nothing is left paused.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
EXIT_SIGTERM = 128 + signal.SIGTERM
SIZE = ("--rollouts", "5", "--steps", "6")


class Driver:
    """One `demo` process, its stdout read line by line."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_ADDRESS": ""}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coordination.demo", *args, "--json"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []

    def until(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                _, err = self.proc.communicate(timeout=60)
                raise AssertionError(f"no {prefix!r} line; stderr: {err[-3000:]}")
            self.lines.append(line)
            if line.startswith(prefix):
                return line.strip()

    def send(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def finish(self, timeout_s: float = 120) -> tuple[int, dict[str, Any]]:
        out, err = self.proc.communicate(timeout=timeout_s)
        lines = ("".join(self.lines) + out).strip().splitlines()
        assert lines, err[-3000:]
        return self.proc.returncode, json.loads(lines[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def latest(root: Path) -> dict[str, str]:
    return dict(json.loads((root / "LATEST").read_text()))


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, dict[str, Any], float]:
    """A run on 2 nodes: SIGUSR1, then SIGTERM; (root, status, json, seconds to exit)."""
    root = tmp_path_factory.mktemp("signals") / "root"
    d = Driver("--until-signal", "--checkpoint-dir", str(root), "--nodes", "2", *SIZE)
    try:
        d.until("in flight: ")
        d.send(signal.SIGUSR1)
        assert d.until("checkpoint on SIGUSR1: ").startswith("checkpoint on SIGUSR1: ok ")
        time.sleep(0.3)  # the rollouts go on after it
        sent = time.monotonic()
        d.send(signal.SIGTERM)
        status, out = d.finish()
        return root, status, out, time.monotonic() - sent
    finally:
        d.kill()


def test_sigterm_checkpoints_inside_the_budget_and_exits(
    stopped: tuple[Path, int, dict[str, Any], float],
) -> None:
    root, status, out, exit_s = stopped
    assert status == EXIT_SIGTERM, out
    # Checkpoint, cleanup and a local cluster's shutdown: inside Kubernetes' 30 s.
    assert exit_s < 30
    assert out["nodes"] == 2
    assert out["stopped_by"] == "SIGTERM"
    assert out["checkpoint_ok"] is True
    assert out["episodes_in_flight"] > 0
    usr1, term = out["signal_checkpoints"]
    assert (usr1["trigger"], usr1["stop"], usr1["ok"]) == ("SIGUSR1", False, True)
    assert (term["trigger"], term["stop"], term["ok"]) == ("SIGTERM", True, True)
    assert term["seconds"] < term["grace_s"]
    assert term["prepare_s"] + term["commit_s"] < term["grace_s"]
    # The SIGTERM one is `latest`, complete, with the driver's state beside it.
    name = Path(term["location"]).name
    assert latest(root) == {"name": name, "checkpoint_id": out["checkpoint_id"]}
    assert (root / name / "gym" / "_manifest.json").exists()
    assert (root / name / "demo" / "driver.json").exists()


def test_a_budget_too_short_fails_whole_and_latest_stays(
    stopped: tuple[Path, int, dict[str, Any], float],
) -> None:
    root = stopped[0]
    before = latest(root)
    d = Driver(
        *("--resume", "latest", "--until-signal", "--checkpoint-dir", str(root), *SIZE),
        # Verifies take long, so no prepare reaches its boundaries in 50 ms.
        *("--grace", "0.05", "--verify-delay", "1.0"),
    )
    try:
        d.until("in flight: ")
        d.send(signal.SIGTERM)
        assert d.until("checkpoint on SIGTERM: ").startswith("checkpoint on SIGTERM: failed ")
        status, out = d.finish()
    finally:
        d.kill()
    assert status == EXIT_SIGTERM, out
    assert out["stopped_by"] == "SIGTERM"
    assert out["checkpoint_ok"] is False
    assert out["checkpoint_id"] is None
    (term,) = out["signal_checkpoints"]
    assert term["error"]["code"] in ("deadline_exceeded", "coordination_failed")
    assert latest(root) == before
    assert not (root / Path(term["location"]).name / "gym" / "_manifest.json").exists()


def test_resume_latest_equals_the_uninterrupted_run_and_sigusr1_goes_on(
    stopped: tuple[Path, int, dict[str, Any], float],
) -> None:
    root, _, first, _ = stopped
    d = Driver("--resume", "latest", "--until-signal", "--checkpoint-dir", str(root), *SIZE)
    try:
        d.until("in flight: ")
        d.send(signal.SIGUSR1)
        assert d.until("checkpoint on SIGUSR1: ").startswith("checkpoint on SIGUSR1: ok ")
        status, out = d.finish()
    finally:
        d.kill()
    assert status == 0, out
    assert out["resumed_from"] == first["checkpoint_dir"]
    assert out["equal"] is True
    assert out["ok"] is True
    assert out["episodes_continued"] == first["episodes_in_flight"]
    assert out["episodes_finished_before"] == first["finished"]
    # The restore's restart bias, as the main run reports it (tokens: the model's).
    bias = out["restart_bias"]
    assert sum(r["continued"] for r in bias.values()) >= out["episodes_continued"] > 0
    assert sum(t.get("continued", 0) for t in out["restart_bias_tokens"].values()) > 0
    assert out["stopped_by"] is None
    # SIGUSR1 checkpointed and everyone went on: nothing paused, nothing open.
    assert out["paused_after"] == []
    assert out["open_checkpoint_after"] is None
    (usr1,) = out["signal_checkpoints"]
    assert usr1["ok"] is True
    assert latest(root)["name"] == Path(usr1["location"]).name
