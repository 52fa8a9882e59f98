"""`ray-ckpt demo --nodes 3 --partition --json`, run as a user runs it.

The demo makes its own test bed (namespaces named after its own process,
beside the suite's `cluster`, which it does not use), cuts the node of the
environment mid-flight, restores, heals, and reports the zombie fenced.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coordination.demo import netbed

pytestmark = [pytest.mark.ray, pytest.mark.slow]

KEYS = ("partitioned_node", "detected_s", "zombie_attempts", "zombie_refused")


def test_demo_partition_fences_the_zombie_and_results_equal(tmp_path: Path) -> None:
    missing = netbed.capabilities()
    if missing:
        pytest.fail("the partition suite needs: " + "; ".join(missing), pytrace=False)
    ray_ckpt = str(Path(sys.executable).with_name("ray-ckpt"))
    proc = subprocess.Popen(
        [ray_ckpt, "demo", "--nodes", "3", "--partition", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-4000:]
    lines = out.strip().splitlines()
    summary = json.loads(lines[-1])
    # Beside the demo's usual keys, the partition's, with these names.
    assert {"equal", "episodes_continued", "ok", *KEYS} <= set(summary)
    assert summary["equal"] is True
    assert summary["ok"] is True, summary["problems"]
    assert summary["episodes_continued"] >= 1
    assert summary["partitioned_node"] in ("b", "c")
    assert summary["detected_s"] > 0
    # The zombie tried something after the heal, and every one of it was refused.
    assert summary["zombie_attempts"] >= 1
    assert summary["zombie_refused"] == summary["zombie_attempts"]
    # The checkpoint open at the cut failed typed (it never completed without the node).
    assert summary["commit_during_cut"] != "ok"
    # The table says it too.
    table = "\n".join(lines[:-1])
    for label in ("partitioned node", "zombie tried after the heal", "zombie refused"):
        assert label in table
    # Nothing of the demo's test bed is left behind.
    left = netbed.sh("ip netns list").stdout
    assert f"{netbed.PREFIX}{proc.pid}-" not in left
