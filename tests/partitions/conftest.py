"""Real network partitions between real Ray nodes on this machine.

The suite runs last (`tests/conftest.py` orders it after the multi-node
suite, whose cluster is shut down by then).  It needs root, `ip` (iproute2)
and `nft` (nftables): a machine without them FAILS the suite with a message
(`.ci/run` installs nftables); nothing is skipped silently.

`cluster` (package scope): the test bed of `coordination/demo/netbed.py`
(shared with `ray-ckpt demo --partition`) with a head `a` (GCS)
and two workers `b` and `c`, each `ray start`ed in its own namespace with a
`node_<name>` resource (workers also `worker_node`).  `drive(scenario)` runs
`tests/partitions/driver.py` inside the head's namespace, applies the faults
it asks for and returns its summary; a node Ray declared dead is started
anew before the next scenario.  Every namespace, veth and process is removed
when the package ends, on failure too, and leftovers of a killed run are
removed when the next one starts.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from coordination.demo import netbed

REPO = Path(__file__).resolve().parents[2]
WORKER_RESOURCES = {"worker_node": 1.0}
DRIVER_TIMEOUT_S = 240.0
S3_BUCKET = "ray-ckpt-partitions"


@dataclass
class Cluster:
    bed: netbed.Bed
    dead: set[str] = field(default_factory=set)  # nodes Ray declared dead (to restart)

    def ensure_nodes(self) -> None:
        for node in sorted(self.dead):
            self.bed.restart_node(node)
        self.dead.clear()

    def drive(self, scenario: str, root: str, tmp: Path, **args: Any) -> dict[str, Any]:
        """Run one scenario's driver in the head's namespace; its summary.
        `root`: the checkpoint root (a directory or s3://); `tmp`: the test's
        directory (gates, the driver's stderr, the summary)."""
        self.ensure_nodes()
        payload = {
            "gcs": self.bed.gcs,
            "ip": self.bed.nodes["a"].ip,
            "root": root,
            "tmp": str(tmp),
            **args,
        }
        env = self.bed.env({"PYTHONPATH": str(REPO)})
        proc = self.bed.popen(
            "a",
            [sys.executable, "-m", "tests.partitions.driver", scenario, json.dumps(payload)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(tmp / "driver.err", "w"),  # noqa: SIM115
            cwd=str(REPO),
            env=env,
        )
        assert proc.stdin is not None
        assert proc.stdout is not None
        # A driver that hangs without a word is ended (its stdout closes).
        watchdog = threading.Timer(DRIVER_TIMEOUT_S, proc.kill)
        watchdog.start()
        summary: dict[str, Any] | None = None
        try:
            for line in proc.stdout:
                if not line.startswith("@@"):
                    continue
                msg = json.loads(line[2:])
                if "summary" in msg:
                    summary = msg["summary"]
                    continue
                if "error" in msg:
                    err = (tmp / "driver.err").read_text()[-4000:]
                    raise AssertionError(f"{scenario} failed: {msg}\n{err}")
                answer = self.fault(msg)
                proc.stdin.write(json.dumps(answer) + "\n")
                proc.stdin.flush()
            proc.wait(timeout=30)
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            self.bed.heal_all()
        if summary is None:
            err = (tmp / "driver.err").read_text()[-4000:]
            raise AssertionError(f"{scenario}: no summary (exit {proc.returncode})\n{err}")
        summary["faults"] = list(self.bed.log)
        self.bed.log.clear()
        # Kept beside the root: what a failed assertion abbreviates is all here.
        (tmp / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def fault(self, msg: dict[str, Any]) -> dict[str, Any]:
        node = msg["node"]
        what = msg["fault"]
        if what == "cut":
            self.bed.cut(node)
            self.dead.add(node)  # a cut long enough for Ray to notice ends the node
        elif what == "lossy":
            self.bed.lossy(node, int(msg["percent"]), delay_ms=int(msg.get("delay_ms", 0)))
        elif what == "one_way":
            self.bed.one_way(node)
        elif what == "heal":
            self.bed.heal(node)
        elif what == "wait_gone":
            return {"ok": True, **self.wait_gone(node)}
        else:
            return {"ok": False, "error": f"unknown fault {what!r}"}
        return {"ok": True}

    def wait_gone(self, node: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """After the heal, a node Ray declared dead ends its processes (its
        raylet is told it is dead); how long that took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            found = map(_cmdline, self.bed.processes(node))
            left = [c for c in found if c is not None and not _tailer(c)]
            if not left:
                return {"gone": True, "after_s": round(time.monotonic() - t0, 2)}
            time.sleep(0.2)
        return {"gone": False, "left": left}


def _cmdline(pid: int) -> str | None:
    """A running process's command line; None if it has ended: vanished
    since it was listed, or a zombie waiting to be reaped (which once
    counted as left and kept a node whose processes had ended 'alive')."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rpartition(")")[2].split()[0] == "Z":
            return None
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except (OSError, IndexError):
        return None


def pytest_addoption(parser: pytest.Parser) -> None:
    # `--seeds` is also the simulation's (tests/unit/conftest.py): one option,
    # registered by whichever conftest loads first.
    for name, help_ in (
        ("--seeds", "random partition runs: seeds 0..N-1 (tests/partitions; not in CI)"),
        ("--seeds-from", "the first seed of the random partition runs"),
    ):
        with contextlib.suppress(ValueError):  # already added
            parser.addoption(name, type=int, default=None, help=help_)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "partition_seed" in metafunc.fixturenames:
        n = metafunc.config.getoption("--seeds", default=None) or 0
        first = metafunc.config.getoption("--seeds-from", default=None) or 0
        metafunc.parametrize("partition_seed", range(first, first + n))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Without --seeds the random run has no seed: it is left out (deselected),
    # never reported as a skip.
    if config.getoption("--seeds", default=None):
        return
    keep = [i for i in items if not i.name.startswith("test_seeded_random_partitions")]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


def _tailer(cmdline: str) -> bool:
    """Ray's log monitor outlives its raylet; it only copies log files."""
    return "ray/_private/log_monitor.py" in cmdline


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="package")
def cluster() -> Iterator[Cluster]:
    missing = netbed.capabilities()
    if missing:
        pytest.fail(
            "the partition suite needs: " + "; ".join(missing) + " (.ci/run installs nftables)",
            pytrace=False,
        )
    import ray

    if ray.is_initialized():
        ray.shutdown()  # the suite's shared Ray: every test that needed it has run
    with netbed.bed(_ray_bin()) as bed:
        bed.start_node("a", cpus=2, resources={"node_a": 1.0})
        for node in ("b", "c"):
            bed.start_node(node, cpus=2, resources={f"node_{node}": 1.0, **WORKER_RESOURCES})
        bed.start_s3(sys.executable)
        yield Cluster(bed)


@pytest.fixture
def root(tmp_path: Path) -> str:
    """The checkpoint root: the same file system every namespace sees."""
    path = tmp_path / "root"
    path.mkdir()
    return str(path)


@pytest.fixture
def s3_root() -> str:
    """A fresh prefix in a bucket of the S3 endpoint in the `s` namespace."""
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}"
