"""The partition test bed: Ray nodes in network namespaces made for the run.

Used by the partition suite (`tests/partitions/`) and by
`ray-ckpt demo --nodes 3 --partition`; it needs root, `ip` and `nft`
(`capabilities()` says what is missing).

Layout (every name starts with `rckpt-<pid>-`, the pid of the test process
that made it, so a later run finds and removes what a killed run left):

- `rckpt-<pid>-sw`: the *switch* namespace.  It holds the bridge `br0` and one
  veth end per node (`v-<node>`).  The bridge lives here, not in the host's
  namespace, so the host's network is never touched.
- `rckpt-<pid>-<node>` for each node (`a` the head, `b`, `c` workers, `s` the
  S3 endpoint): loopback and `eth0`, the other end of its veth, with the
  address `10.213.0.<n>/24`.  No route leads anywhere else: the only
  addresses any process here can reach are the ones this module assigned.

Faults act on the links only (the processes on a cut node keep running, as
on a real partition):

- `cut(node)`: the switch's end of the node's veth goes down (both ways).
- `one_way(node)`: nftables in the node's namespace drops what it sends
  (it still receives).
- `lossy(node, percent)`: nftables drops that share of packets both ways at
  random (`numgen random`).  The kernel here has no `sch_netem` (no
  delay/reorder qdisc); `netem_available()` says whether one does, and
  `lossy(..., delay_ms=)` adds netem's delay and reordering there.
- `heal(node)`: every fault on the node undone.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "rckpt-"
SUBNET = "10.213.0"
GCS_PORT = 6379
NODE_NUMBERS = {"a": 1, "b": 2, "c": 3, "s": 250}

# Detection settings for a test cluster (docs/operations/partitions.md,
# "Detection settings", has the production values and what they give):
# a node that stops answering is declared dead after about
# threshold * (timeout + period) = 3 * (1 + 0.5) = 4.5 s.  A check's
# timeout leaves room for two TCP retransmissions (200 ms at least each),
# so that a lossy link is not mistaken for a cut.  A process cut off from
# the GCS gives up on it after 30 s (so a zombie outlives the cuts).
RAY_DETECTION_ENV = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_gcs_rpc_server_reconnect_timeout_s": "30",
}

# The S3 endpoint (moto) in its own namespace; every node and the driver reach it there.
S3_PORT = 5000
S3_ENV = {
    "AWS_ENDPOINT_URL": f"http://{SUBNET}.{NODE_NUMBERS['s']}:{S3_PORT}",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_ALLOW_HTTP": "true",
}
RAY_QUIET = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}


class BedError(RuntimeError):
    """A step of the test bed failed (the command, its output)."""


CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise BedError(f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def inside(ns: str) -> Iterator[None]:
    """This thread (and the threads it starts) in the namespace `ns`, then
    back in the one it was in.  A Ray driver needs a raylet on its own
    address: the demo's process joins the head's namespace for the run
    instead of starting a driver process there (Python 3.11 has no
    `os.setns`, hence libc's)."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(home)


def sh(cmd: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run one command (words split on spaces: no argument here has one)."""
    proc = subprocess.run(cmd.split(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise BedError(f"{cmd} -> {proc.returncode}: {proc.stderr.strip()}")
    return proc


def capabilities() -> list[str]:
    """What this machine lacks for the partition suite (empty: nothing)."""
    missing: list[str] = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces need CAP_NET_ADMIN)")
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            missing.append(f"the `{tool}` command ({'iproute2' if tool == 'ip' else 'nftables'})")
    if missing:
        return missing
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        sh(f"ip netns add {probe}")
        sh(f"ip -n {probe} link add br0 type bridge")
        sh(f"ip -n {probe} link add v0 type veth peer name v1")
        _nft(probe, _loss_ruleset("v0", 10))
    except BedError as exc:
        missing.append(f"namespaces, bridges, veths and nftables loss rules: {exc}")
    finally:
        sh(f"ip netns del {probe}", check=False)
    return missing


def netem_available(ns: str) -> bool:
    probe = sh(f"ip netns exec {ns} tc qdisc add dev lo root netem delay 1ms", check=False)
    return probe.returncode == 0


def _loss_ruleset(dev: str, percent: int, *, inbound: bool = True, outbound: bool = True) -> str:
    chance = "" if percent >= 100 else f"numgen random mod 100 < {percent}"
    lines = ["table inet rckpt_fault {"]
    for hook, match, on in (("input", "iifname", inbound), ("output", "oifname", outbound)):
        if on:
            lines += [
                f"  chain {hook} {{",
                f"    type filter hook {hook} priority 0;",
                f'    {match} "{dev}" {chance} drop',
                "  }",
            ]
    return "\n".join([*lines, "}", ""])


def _nft(ns: str, ruleset: str) -> None:
    proc = subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "-f", "-"],
        input=ruleset,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        raise BedError(f"nft in {ns} -> {proc.returncode}: {proc.stderr.strip()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(ns: str) -> None:
    """End every process in the namespace (ours: only this bed starts any)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in sh(f"ip netns pids {ns}", check=False).stdout.split()]
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.1)


def _delete_namespace(ns: str) -> None:
    _kill_namespace_processes(ns)
    sh(f"ip netns del {ns}", check=False)


def remove_leftovers() -> list[str]:
    """Delete the namespaces (and their processes) of runs whose test process is gone."""
    removed: list[str] = []
    for line in sh("ip netns list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and int(owner) != os.getpid() and _pid_alive(int(owner)):
            continue  # another live run's
        _delete_namespace(name)
        # The node's Ray temp dir (`Bed.start_node`), logs and sockets.
        shutil.rmtree(f"/tmp/{name[len(PREFIX) :].replace('-', '')}", ignore_errors=True)
        removed.append(name)
    return removed


@dataclass
class Node:
    name: str  # a, b, c
    ns: str
    ip: str
    temp_dir: str
    resources: dict[str, float]
    cpus: int


@dataclass
class Bed:
    """The switch, the node namespaces, the Ray nodes and the active faults."""

    run: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    nodes: dict[str, Node] = field(default_factory=dict)
    faults: dict[str, list[str]] = field(default_factory=dict)  # node -> what is active
    log: list[dict[str, object]] = field(default_factory=list)
    ray_bin: str = ""

    @property
    def switch(self) -> str:
        return f"{self.run}-sw"

    @property
    def gcs(self) -> str:
        return f"{SUBNET}.{NODE_NUMBERS['a']}:{GCS_PORT}"

    def ns(self, node: str) -> str:
        return f"{self.run}-{node}"

    # --- network -----------------------------------------------------------
    def make_switch(self) -> None:
        sh(f"ip netns add {self.switch}")
        sh(f"ip -n {self.switch} link set lo up")
        sh(f"ip -n {self.switch} link add br0 type bridge")
        sh(f"ip -n {self.switch} link set br0 up")

    def add_namespace(self, node: str) -> str:
        ns, ip = self.ns(node), f"{SUBNET}.{NODE_NUMBERS[node]}"
        sh(f"ip netns add {ns}")
        sh(f"ip -n {ns} link set lo up")
        # Both veth ends are made inside the switch namespace; one moves to the node's.
        sh(f"ip -n {self.switch} link add v-{node} type veth peer name eth0 netns {ns}")
        sh(f"ip -n {self.switch} link set v-{node} master br0")
        sh(f"ip -n {self.switch} link set v-{node} up")
        sh(f"ip -n {ns} addr add {ip}/24 dev eth0")
        sh(f"ip -n {ns} link set eth0 up")
        return ns

    def cut(self, node: str) -> None:
        sh(f"ip -n {self.switch} link set v-{node} down")
        self._active(node, "cut")

    def one_way(self, node: str) -> None:
        """The node receives but nothing it sends arrives."""
        _nft(self.ns(node), _loss_ruleset("eth0", 100, inbound=False))
        self._active(node, "one_way")

    def lossy(self, node: str, percent: int, *, delay_ms: int = 0) -> None:
        _nft(self.ns(node), _loss_ruleset("eth0", percent))
        if delay_ms and netem_available(self.ns(node)):
            netem = f"netem delay {delay_ms}ms {delay_ms // 2}ms reorder 10%"
            sh(f"ip netns exec {self.ns(node)} tc qdisc add dev eth0 root {netem}")
        self._active(node, f"lossy {percent}%")

    def heal(self, node: str) -> None:
        sh(f"ip -n {self.switch} link set v-{node} up", check=False)
        sh(f"ip netns exec {self.ns(node)} nft delete table inet rckpt_fault", check=False)
        sh(f"ip netns exec {self.ns(node)} tc qdisc del dev eth0 root", check=False)
        self.faults.pop(node, None)
        self.log.append({"at": time.time(), "heal": node})

    def heal_all(self) -> None:
        for node in list(self.faults):
            self.heal(node)

    def _active(self, node: str, what: str) -> None:
        self.faults.setdefault(node, []).append(what)
        self.log.append({"at": time.time(), "fault": what, "node": node})

    # --- Ray ---------------------------------------------------------------
    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
        env.update(RAY_DETECTION_ENV)
        # No token auth between these nodes (Ray turns it on for `ray start --head`):
        # every address is inside namespaces this bed made.
        env.update(RAY_QUIET)
        env.update(S3_ENV)
        env["RAY_AUTH_MODE"] = "disabled"
        # The rest of the suite sets it to 0 (one loopback node); these nodes
        # are several, each on its own address.
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
        env.update(extra or {})
        return env

    def start_node(self, node: str, *, cpus: int, resources: Mapping[str, float]) -> Node:
        ns = self.ns(node)
        if not Path(f"/run/netns/{ns}").exists():
            self.add_namespace(node)
        ip = f"{SUBNET}.{NODE_NUMBERS[node]}"
        temp_dir = f"/tmp/{self.run[len(PREFIX) :]}{node}"  # short: unix socket paths
        args = [
            "ip",
            "netns",
            "exec",
            ns,
            self.ray_bin,
            "start",
            "--node-ip-address",
            ip,
            "--num-cpus",
            str(cpus),
            "--resources",
            json.dumps(dict(resources)),
            "--temp-dir",
            temp_dir,
            "--disable-usage-stats",
        ]
        if node == "a":
            args += ["--head", "--port", str(GCS_PORT), "--include-dashboard=false"]
        else:
            args += ["--address", self.gcs]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=120, env=self.env())
        if proc.returncode != 0:
            raise BedError(f"ray start on {node} failed: {proc.stderr[-2000:]}")
        self.nodes[node] = Node(node, ns, ip, temp_dir, dict(resources), cpus)
        return self.nodes[node]

    def start_s3(self, python: str) -> subprocess.Popen[bytes]:
        """moto's S3 server in the `s` namespace (ended with it at teardown)."""
        self.add_namespace("s")
        ip = f"{SUBNET}.{NODE_NUMBERS['s']}"
        argv = ["ip", "netns", "exec", self.ns("s"), python, "-m", "moto.server"]
        return subprocess.Popen(
            [*argv, "-H", ip, "-p", str(S3_PORT)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def restart_node(self, node: str) -> None:
        """A node Ray declared dead stays dead: its processes end, a new raylet joins."""
        spec = self.nodes[node]
        _kill_namespace_processes(spec.ns)
        self.start_node(node, cpus=spec.cpus, resources=spec.resources)

    def processes(self, node: str) -> list[int]:
        return [int(p) for p in sh(f"ip netns pids {self.ns(node)}").stdout.split()]

    def popen(self, node: str, argv: Sequence[str], **kw: object) -> subprocess.Popen[str]:
        return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
            ["ip", "netns", "exec", self.ns(node), *argv], text=True, **kw
        )

    def teardown(self) -> None:
        """Every process, veth, namespace and temp dir this bed made, gone."""
        ours = [
            line.split()[0]
            for line in sh("ip netns list", check=False).stdout.splitlines()
            if line.startswith(self.run + "-")
        ]
        # Nodes first (their processes end while the switch still carries
        # their goodbyes), the switch last: its veth ends and bridge go with it.
        for ns in sorted(ours, key=lambda n: n == self.switch):
            _delete_namespace(ns)
        for node in self.nodes.values():
            shutil.rmtree(node.temp_dir, ignore_errors=True)
        self.nodes.clear()
        self.faults.clear()


@contextlib.contextmanager
def bed(ray_bin: str) -> Iterator[Bed]:
    remove_leftovers()
    b = Bed(ray_bin=ray_bin)
    try:
        b.make_switch()
        yield b
    finally:
        b.teardown()
