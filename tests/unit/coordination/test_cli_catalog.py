"""`ray-ckpt list`, `gc`, `restore --latest` and the up-front location checks,
run as the real click commands against real checkpoint directories."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from click.testing import CliRunner

import coordination.cli.commands as cli
from coordination.cli.commands import main
from coordination.engine.results import RestoreResult
from tests.unit.storage.catalog_fixtures import commit, files

T0 = 1_700_000_000.0
FIELDS = {
    "name",
    "checkpoint_id",
    "time",
    "participants",
    "episodes",
    "bytes",
    "complete",
    "referenced_by",
    "stored_bytes",
}


def run(*args: str) -> Any:
    # Wide enough that rich's tables do not wrap a cell the assertions look for.
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "240"})


@pytest.fixture
def root(tmp_path: pathlib.Path) -> pathlib.Path:
    commit(tmp_path, "step-1", T0, episodes=2)
    commit(tmp_path, "step-2", T0 + 60, episodes=3)
    commit(tmp_path, "step-3", T0 + 120, episodes=4, gym_manifest=False)
    return tmp_path


def test_list_json_is_one_object_per_checkpoint_with_exactly_the_fields(
    root: pathlib.Path,
) -> None:
    result = run("list", str(root), "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [set(r) for r in rows] == [FIELDS] * 3
    assert [(r["name"], r["complete"], r["episodes"]) for r in rows] == [
        ("step-1", True, 2),
        ("step-2", True, 3),
        ("step-3", False, 4),
    ]
    assert rows[0]["checkpoint_id"] == "ckpt-step-1"
    assert rows[0]["time"] == T0
    assert rows[0]["participants"] == 2
    assert rows[0]["bytes"] > 0
    assert rows[0]["referenced_by"] == []


def test_list_prints_a_table(root: pathlib.Path) -> None:
    result = run("list", str(root))
    assert result.exit_code == 0, result.output
    assert "3 checkpoints" in result.output
    for text in ("step-1", "step-2", "step-3", "ckpt-step-2", "2023-11-14 22:13:20"):
        assert text in result.output
    assert result.output.count(" yes ") == 2
    assert result.output.count(" no ") == 1


@pytest.mark.parametrize("command", [["list"], ["gc", "--keep", "1"]])
@pytest.mark.parametrize(
    ("location", "why", "code", "exit_code"),
    [
        ("relative/ckpt", "relative path", "invalid_request", 2),
        ("s4://bucket/x", "unknown scheme", "invalid_request", 2),
        ("/nonexistent/ray-ckpt-root", "does not exist", "not_found", 3),
    ],
)
def test_a_bad_root_is_refused_naming_it(
    command: list[str], location: str, why: str, code: str, exit_code: int
) -> None:
    result = run(*command, location, "--json")
    assert result.exit_code == exit_code
    error = json.loads(result.stdout)["error"]
    assert error["code"] == code
    assert location in error["detail"]
    assert why in error["detail"]
    plain = run(*command, location)
    assert plain.exit_code == exit_code
    assert plain.stdout == ""
    assert [line for line in plain.stderr.splitlines()] == [plain.stderr.strip()]
    assert location in plain.stderr


def test_gc_dry_run_prints_the_plan_and_deletes_nothing(root: pathlib.Path) -> None:
    before = files(root)
    result = run("gc", str(root), "--keep", "1", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "would delete" in result.output
    assert "dry run" in result.output
    assert "step-1" in result.output
    assert files(root) == before
    plan = json.loads(run("gc", str(root), "--keep", "1", "--dry-run", "--json").output)
    assert plan["dry_run"] is True
    assert plan["deleted"] is False
    deleting = {r["name"] for r in plan["rows"] if r["action"] == "delete"}
    assert deleting == {"step-1"}  # step-3 is incomplete and newest: may be in flight
    assert files(root) == before


def test_gc_deletes_what_the_plan_said(root: pathlib.Path) -> None:
    planned = json.loads(run("gc", str(root), "--keep", "1", "--dry-run", "--json").output)
    result = run("gc", str(root), "--keep", "1", "--json")
    assert result.exit_code == 0, result.output
    done = json.loads(result.output)
    assert done["deleted"] is True
    assert done["delete"] == planned["delete"]
    assert not any(f.startswith("step-1/") for f in files(root))
    rows = json.loads(run("list", str(root), "--json").output)
    assert [r["name"] for r in rows] == ["step-2", "step-3"]


@pytest.mark.parametrize("keep", ["0", "-2"])
def test_gc_refuses_to_keep_none(root: pathlib.Path, keep: str) -> None:
    before = files(root)
    result = run("gc", str(root), "--keep", keep, "--json")
    assert result.exit_code == 2
    assert json.loads(result.stdout)["error"]["code"] == "invalid_request"
    assert files(root) == before


class _Handle:
    def __init__(self) -> None:
        self.asked: list[tuple[str, Any, dict[str, Any]]] = []

    def restore(self, directory: str, keys: Any, **kwargs: Any) -> RestoreResult:
        self.asked.append((directory, keys, kwargs))
        return RestoreResult(
            checkpoint_id="restore-1",
            source_checkpoint_id="ckpt-step-2",
            checkpoint_dir=f"{directory}/step-2",
            total_s=0.0,
            timings={},
            restored={},
            resumed=True,
        )


def test_restore_latest_asks_the_coordinator_for_the_root(
    root: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = _Handle()
    monkeypatch.setattr(cli, "_connect", lambda address, namespace: handle)
    result = run("restore", str(root), "--latest", "--namespace", "n")
    assert result.exit_code == 0, result.output
    assert handle.asked[-1] == (
        str(root),
        None,
        {"allow_without_gym_manifest": False, "latest": True},
    )
    assert f"{root}/step-2" in result.output
    result = run("restore", str(root), "--latest", "--episode", "r1", "--namespace", "n")
    assert result.exit_code == 0, result.output
    assert handle.asked[-1][1] == ["r1"]


@pytest.mark.parametrize(
    "args",
    [
        ["checkpoint", "relative/ckpt"],
        ["checkpoint", "gopher://host/x"],
        ["restore", "relative/ckpt", "--latest"],
        ["restore", "relative/ckpt", "--episode", "r1"],
    ],
)
def test_checkpoint_and_restore_refuse_a_bad_location_before_attaching(
    args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_cluster(address: str, namespace: str) -> Any:
        raise AssertionError("attached to Ray for a location that cannot work")

    monkeypatch.setattr(cli, "_connect", no_cluster)
    result = run(*args, "--json")
    assert result.exit_code == 2
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "invalid_request"
    assert args[1] in error["detail"]


def test_list_and_gc_are_listed() -> None:
    result = run("--help")
    assert result.exit_code == 0
    for name in ("list", "gc"):
        assert name in result.output
