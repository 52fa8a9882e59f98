"""Signal checkpointing's plumbing with real signals to this process (and to a
child process for the exit), against a stand-in for the coordinator's
`acheckpoint` (the Ray-backed run is tests/e2e/test_signals.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import pytest

from coordination.engine.options import CheckpointOptions
from coordination.triggers.signals import SignalCheckpoint, SignalCheckpointing, cut_budget
from ray_ckpt.errors import DeadlineExceeded, InvalidRequest
from tests.unit.helpers import until


class Result:
    def __init__(self, where: str) -> None:
        self.checkpoint_id = "ckpt-" + where.rsplit("/", 1)[-1]
        self.continued = ["r0"]
        self.restart: list[str] = []


class StandIn:
    """Records each checkpoint call; `gate` holds it until set."""

    def __init__(self, hold_s: float = 0.0) -> None:
        self.calls: list[dict[str, Any]] = []
        self.gate = asyncio.Event()
        self.hold_s = hold_s
        if not hold_s:
            self.gate.set()

    async def acheckpoint(self, options: CheckpointOptions) -> Result:
        # As the handle's: one struct, the engine checks it (a valid one here).
        assert isinstance(options, CheckpointOptions)
        options.check()
        where = options.checkpoint_dir
        self.calls.append({"where": where, **msgspec.structs.asdict(options)})
        if self.hold_s:
            await asyncio.sleep(self.hold_s)
        await self.gate.wait()
        return Result(where)


def test_budget_fits_the_grace_left() -> None:
    b = cut_budget(10.0, 3.0)
    assert b.wait_s == pytest.approx(7.0)
    assert b.prepare_s + b.commit_s == pytest.approx(7.0 - 1.0)  # 10% kept back
    assert 0 < b.prepare_s < b.commit_s
    # The coordinator's overall deadline: after the phases, before the driver gives up.
    assert b.prepare_s + b.commit_s < b.total_s < b.wait_s
    assert cut_budget(100.0, 0.0).prepare_s + cut_budget(100.0, 0.0).commit_s == 98.0
    with pytest.raises(DeadlineExceeded):
        cut_budget(1.0, 0.95)


@pytest.mark.parametrize(
    "kw",
    [
        {"signals": [signal.SIGKILL]},
        {"signals": []},
        {"grace_s": 0},
        {"grace_s": float("nan")},
        {"root": "relative/root"},
        {"root": "ftp://host/root"},
    ],
)
def test_bad_settings_are_invalid_requests(kw: dict[str, Any]) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(InvalidRequest):
        SignalCheckpointing(StandIn(), **{"root": "/tmp/root", **kw}).install()
    assert signal.getsignal(signal.SIGTERM) is before  # nothing installed


async def test_sigusr1_checkpoints_continues_and_restores_the_handler() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    coord = StandIn()
    sc = SignalCheckpointing(coord, "/ckpt/root", scope=lambda: ["r0", "r1"], grace_s=10).install()
    os.kill(os.getpid(), signal.SIGUSR1)
    await until(lambda: sc.outcomes)
    (call,) = coord.calls
    assert call["resume"] is True
    assert call["stop"] is False
    assert call["where"].startswith("/ckpt/root/ckpt-")
    assert call["where"].endswith("-sigusr1")
    assert [e.rollout_id for e in call["scope"]] == ["r0", "r1"]
    assert call["prepare_s"] + call["commit_s"] <= 10 - 1.0 + 1e-9
    # The coordinator is held to the budget too, not only the driver's wait.
    assert call["prepare_s"] + call["commit_s"] < call["total_s"] < 10
    assert call["trigger"] == "signal"
    assert call["durability"] == "sync"
    out = sc.outcomes[0]
    assert out.ok
    assert out.trigger == "SIGUSR1"
    assert not out.stop
    assert out.error is None
    assert signal.getsignal(signal.SIGUSR1) is not before  # ours while installed
    sc.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is before


async def test_a_signal_during_a_checkpoint_joins_it() -> None:
    coord = StandIn(hold_s=0.01)
    coord.gate.clear()
    stops: list[SignalCheckpoint] = []
    sc = SignalCheckpointing(coord, "/r", grace_s=10, on_stop=stops.append).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        await until(lambda: coord.calls)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # joins: exit after it
        await asyncio.sleep(0.1)
        coord.gate.set()
        await until(lambda: stops)
    finally:
        sc.uninstall()
    assert len(coord.calls) == 1
    assert stops[0].joined == ["SIGUSR1", "SIGTERM"]
    assert stops[0].trigger == "SIGUSR1"


async def test_sigterm_stops_and_a_second_one_is_ignored() -> None:
    before = signal.getsignal(signal.SIGTERM)
    coord = StandIn()
    coord.gate.clear()
    stops: list[SignalCheckpoint] = []
    sc = SignalCheckpointing(coord, "/r", grace_s=10, on_stop=stops.append).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await until(lambda: coord.calls)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.1)
        assert not stops
        coord.gate.set()
        await until(lambda: stops)
    finally:
        sc.uninstall()
    (call,) = coord.calls
    assert call["stop"] is True
    assert call["resume"] is False
    assert call["scope"] is None
    assert call["trigger"] == "signal"
    assert stops[0].ok
    assert stops[0].stop
    assert stops[0].joined == []
    assert signal.getsignal(signal.SIGTERM) is before  # put back before on_stop


async def test_a_budget_too_short_fails_the_checkpoint_in_time() -> None:
    coord = StandIn(hold_s=5.0)
    stops: list[SignalCheckpoint] = []
    sc = SignalCheckpointing(coord, "/r", grace_s=0.3, on_stop=stops.append).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await until(lambda: stops, timeout=2.0)
    finally:
        sc.uninstall()
    out = stops[0]
    assert not out.ok
    assert out.checkpoint_id is None
    assert out.error is not None
    assert out.error["code"] == "deadline_exceeded"
    assert out.seconds < 1.0


DRIVER = """
import asyncio, os, signal, sys, time
from coordination.triggers.signals import SignalCheckpointing

class Coord:
    async def acheckpoint(self, o):
        await asyncio.sleep(0.2)
        open(sys.argv[2], "w").write(f"{o.checkpoint_dir} stop={o.stop} resume={o.resume}")
        class R: checkpoint_id = "c1"; continued = []; restart = []
        return R()

def ready():
    print("ready", flush=True)

if sys.argv[1] == "loop":
    async def main():
        SignalCheckpointing(Coord(), "/r", grace_s=5).install()
        ready()
        await asyncio.sleep(30)
    asyncio.run(main())
else:  # a synchronous training loop
    SignalCheckpointing(Coord(), "/r", grace_s=5).install()
    ready()
    time.sleep(30)
print("not stopped", flush=True)
"""


@pytest.mark.parametrize("mode", ["loop", "thread"])
def test_sigterm_checkpoints_then_the_process_dies_of_it(tmp_path: Path, mode: str) -> None:
    script, marker = tmp_path / "driver.py", tmp_path / "done"
    script.write_text(textwrap.dedent(DRIVER))
    proc = subprocess.Popen(
        [sys.executable, str(script), mode, str(marker)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[3],
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == -signal.SIGTERM  # the default action, after the checkpoint
    assert "not stopped" not in out
    assert marker.read_text().endswith("-sigterm stop=True resume=False")


@pytest.mark.parametrize(
    "args",
    [
        ["--until-signal"],  # no root
        ["--until-signal", "--checkpoint-dir", "relative/root"],
        ["--resume", "latest", "--checkpoint-dir", "/nonexistent/ray-ckpt-root"],
        ["--until-signal", "--checkpoint-dir", "/tmp/x", "--grace", "0"],
    ],
)
def test_the_demo_refuses_a_bad_root_or_budget_before_ray_starts(
    args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import coordination.demo.run as run

    started: list[object] = []
    # Whether or not the session's Ray is up already: the demo never gets as
    # far as starting (or attaching to) one.
    monkeypatch.setattr(run, "start_ray", lambda *a, **k: started.append(a))
    assert run.demo_command_main(args) == 2  # a usage error
    assert started == []
