"""`ray-ckpt demo --partition` without what it needs: one error line, exit 5.

The test bed needs root and the `ip` and `nft` commands; without them the
demo says so before anything starts (no namespace, no Ray) instead of a
traceback minutes in.
"""

from __future__ import annotations

import pytest

from coordination.cli.output import ExitCode
from coordination.demo import netbed, partition, run
from coordination.demo.report import DemoReport


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    started: list[object] = []
    monkeypatch.setattr(partition, "run_partition", lambda *a, **k: started.append(a))
    monkeypatch.setattr(run, "start_ray", lambda *a, **k: started.append(a))
    return started


def test_no_root_and_no_ip_is_one_unavailable_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    nothing_starts: list[object],
) -> None:
    monkeypatch.setattr(netbed.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netbed.shutil, "which", lambda tool: None if tool == "ip" else "/x")
    code = run.demo_command_main(["--nodes", "3", "--partition", "--json"])
    assert code == ExitCode.UNAVAILABLE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error (unavailable): --partition needs root")
    assert "`ip` command" in err[0]
    assert "Traceback" not in err[0]
    assert nothing_starts == []


def test_root_without_nft_names_it(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    nothing_starts: list[object],
) -> None:
    monkeypatch.setattr(netbed.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netbed.shutil, "which", lambda tool: None if tool == "nft" else "/x")
    assert run.demo_command_main(["--nodes", "3", "--partition"]) == ExitCode.UNAVAILABLE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "`nft` command (nftables)" in err[0]
    assert "root (" not in err[0]
    assert nothing_starts == []


@pytest.mark.parametrize(
    "args",
    [
        ["--partition"],  # one node: nothing to cut
        ["--nodes", "2", "--partition"],
        ["--nodes", "3", "--partition", "--kill-node"],
        ["--nodes", "3", "--partition", "--timeline", "/tmp/t.json"],
    ],
)
def test_partition_usage_errors(args: list[str], nothing_starts: list[object]) -> None:
    assert run.demo_command_main(args) == ExitCode.BAD_INPUT
    assert nothing_starts == []


def test_a_store_uri_is_refused_the_nodes_reach_nothing_beyond_the_bed(
    capsys: pytest.CaptureFixture[str], nothing_starts: list[object]
) -> None:
    args = ["--nodes", "3", "--partition", "--checkpoint-dir", "s3://bucket/x"]
    assert run.demo_command_main(args) == ExitCode.BAD_INPUT
    assert "--partition needs a local --checkpoint-dir" in capsys.readouterr().err
    assert nothing_starts == []


def test_partition_keys_and_a_zombie_not_refused_fails_the_run() -> None:
    report = DemoReport(rollouts=4, steps=2, nodes=3)
    report.equal, report.in_scope, report.continued = True, 4, ["r0"]
    report.partitioned_node, report.detected_s = "b", 4.2
    report.commit_during_cut = "coordination_failed"
    report.zombie_tried = {"late request with its old attempt": 3}
    report.zombie_refused_by = {"stale_attempt": 3}
    s = report.summary()
    assert (s["partitioned_node"], s["detected_s"]) == ("b", 4.2)
    assert (s["zombie_attempts"], s["zombie_refused"]) == (3, 3)
    assert report.ok
    report.zombie_refused_by = {"stale_attempt": 2}
    assert report.problems() == ["a late call of the zombie was not refused"]
    # The other modes' JSON does not change.
    assert "zombie_attempts" not in DemoReport(rollouts=1, steps=1).summary()
