"""Network partitions between real Ray nodes (see conftest.py and driver.py).

Each scenario runs in the driver inside the head's namespace; the test
applies the faults it asks for, then checks its summary against the
invariants (`invariants.check`) and the scenario's own promises.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.partitions.conftest import Cluster
from tests.partitions.invariants import check

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _participant_cut(s: dict[str, Any]) -> None:
    check(s)
    # The checkpoint open at the cut failed typed; nothing of it verifies.
    assert s["commit_during_cut"] != "ok", s["events"]
    assert not s["verified"]["c2"]
    # The zombie wrote nothing into the failed checkpoint after Ray declared it dead.
    assert s["late_writes"] == {"c2": []}
    # Lost members were restored from LATEST (c1) and continued from it.
    assert s["continued"], s["events"]
    # A checkpoint after the heal completes and becomes LATEST.
    assert s["third"]["outcome"] == "ok", s["third"]
    assert s["latest"]["name"] == "c3"
    # Once healed, the node Ray declared dead ends its processes, the zombie servers too.
    gone = [e for e in s["events"] if e["what"] == "zombie processes gone"]
    assert gone, s["events"]
    assert gone[0]["gone"], gone


def test_participant_node_cut_mid_checkpoint(cluster: Cluster, root: str, tmp_path: Path) -> None:
    _participant_cut(cluster.drive("participant_cut", root, tmp_path, seed=1))


def test_participant_node_cut_with_s3_storage(
    cluster: Cluster, s3_root: str, tmp_path: Path
) -> None:
    """The same cut with the checkpoints in S3 (moto in its own namespace)."""
    _participant_cut(cluster.drive("participant_cut", s3_root, tmp_path, seed=6))


def _lossy_link(s: dict[str, Any]) -> None:
    check(s)
    assert s["after"]["outcome"] == "ok", s["after"]


def test_lossy_link_across_checkpoints(cluster: Cluster, root: str, tmp_path: Path) -> None:
    _lossy_link(cluster.drive("lossy_link", root, tmp_path, seed=2, percent=20))


def _restore_cut(s: dict[str, Any]) -> None:
    check(s)
    assert s["restore_during_cut"] != "ok", s["events"]
    assert s["continued"], s["events"]


def test_node_cut_during_restore(cluster: Cluster, root: str, tmp_path: Path) -> None:
    _restore_cut(cluster.drive("restore_cut", root, tmp_path, seed=3))


def _coordinator_moved_and_fenced(s: dict[str, Any]) -> None:
    home, new_home = s["moved"]
    assert new_home != home, "Ray restarted the coordinator on another node"
    assert s["new_epoch"] > s["old_epoch"], (s["old_epoch"], s["new_epoch"])
    # Every host has seen the newer epoch by the next checkpoint: the old
    # coordinator is refused there from then on.
    assert {v["epoch"] for v in s["fencing_end"].values()} == {s["new_epoch"]}, s["fencing_end"]
    assert s["third"]["outcome"] == "ok", s["third"]
    assert s["latest"]["name"] == "c3"


def _coordinator_cut_mid_checkpoint(s: dict[str, Any]) -> None:
    check(s)
    _coordinator_moved_and_fenced(s)
    # The new coordinator's recovery aborted c2 with calls carrying its epoch:
    # every host had seen it before the heal.
    assert {v["epoch"] for v in s["fencing"].values()} == {s["new_epoch"]}, s["fencing"]
    # After the heal the old coordinator's late calls reached the hosts and were
    # refused (stale_coordinator), and its open checkpoint never became complete
    # or LATEST.
    refused = {k: v["fenced"].get("stale_coordinator", 0) for k, v in s["fencing"].items()}
    assert sum(refused.values()) >= 1, s["events"]
    assert not s["verified"]["c2"]


def test_coordinator_node_cut_mid_checkpoint(cluster: Cluster, root: str, tmp_path: Path) -> None:
    _coordinator_cut_mid_checkpoint(
        cluster.drive("coordinator_cut_mid_checkpoint", root, tmp_path, seed=4)
    )


def _coordinator_cut_idle(s: dict[str, Any]) -> None:
    check(s)
    _coordinator_moved_and_fenced(s)


def test_coordinator_node_cut_while_idle(cluster: Cluster, root: str, tmp_path: Path) -> None:
    _coordinator_cut_idle(cluster.drive("coordinator_cut_idle", root, tmp_path, seed=5))


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "participant_cut": _participant_cut,
    "lossy_link": _lossy_link,
    "restore_cut": _restore_cut,
    "coordinator_cut_mid_checkpoint": _coordinator_cut_mid_checkpoint,
    "coordinator_cut_idle": _coordinator_cut_idle,
}


def test_seeded_random_partitions(
    cluster: Cluster, partition_seed: int, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """`--seeds N` (not in CI): seed k draws a scenario, its store (a
    directory or S3), the lossy link's rate, and every drawn time inside the
    driver (when a cut comes, how long it lasts); each is checked like its
    fixed test.  A failing seed is replayed with `--seeds-from k --seeds 1`."""
    rng = random.Random(partition_seed)
    scenario = rng.choice(sorted(CHECKS))
    root = (
        request.getfixturevalue("s3_root")
        if rng.random() < 0.3
        else request.getfixturevalue("root")
    )
    s = cluster.drive(scenario, root, tmp_path, seed=partition_seed, percent=rng.randint(5, 25))
    CHECKS[scenario](s)
