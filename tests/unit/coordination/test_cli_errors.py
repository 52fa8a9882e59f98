"""Every `ray-ckpt` command, given bad input, says so in ONE line on stderr
and exits with its class's code (`coordination.cli.output.ExitCode`): no
traceback, no Python warning; `--debug` shows the traceback.  No Ray is
needed: an address with nothing behind it is refused before Ray is asked."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
from typing import Any

import pytest
from click.testing import CliRunner

from coordination.cli.output import EXIT_BY_REASON, ExitCode, error_line, exit_code_of
from coordination.demo.app import main
from ray_ckpt.errors import CoordinationFailed, Reason
from tests.unit.storage.catalog_fixtures import commit

T0 = 1_700_000_000.0


def _dead_address() -> str:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"


@pytest.fixture(autouse=True)
def a_fresh_command_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command as in a process of its own, where Ray is not attached yet.
    The suite's earlier Ray tests leave this process attached to the shared
    cluster, and a command attached already uses that connection, whatever
    `--address` says: the dead address would never be tried."""
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)


def run(*args: str, input_: str | None = None) -> Any:
    return CliRunner().invoke(main, list(args), input=input_, env={"COLUMNS": "240"})


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("root")
    commit(root, "step-1", T0, episodes=2)
    return {"root": str(root), "ckpt": str(root / "step-1"), "dead": _dead_address()}


# (arguments, exit code): {root}, {ckpt} and {dead} are filled in.
CASES: list[tuple[list[str], ExitCode]] = [
    (["no-such-command"], ExitCode.BAD_INPUT),
    (["status", "--address", "{dead}"], ExitCode.UNAVAILABLE),
    (["status", "--address", "not-an-address"], ExitCode.BAD_INPUT),
    (["checkpoint", "relative/dir"], ExitCode.BAD_INPUT),
    (["checkpoint", "{root}"], ExitCode.BAD_INPUT),  # a root, not a checkpoint
    (["checkpoint", "{root}/new", "--address", "{dead}"], ExitCode.UNAVAILABLE),
    (["checkpoint", "{root}/new", "--async", "--keep-open"], ExitCode.BAD_INPUT),
    (["restore", "relative/dir"], ExitCode.BAD_INPUT),
    (["restore", "{root}/missing"], ExitCode.NOT_FOUND),
    (["restore", "{root}"], ExitCode.BAD_INPUT),  # a root without --latest
    (["restore", "{ckpt}", "--latest"], ExitCode.BAD_INPUT),  # a checkpoint with it
    (["restore", "{ckpt}", "--address", "{dead}"], ExitCode.UNAVAILABLE),
    (["retire", "r1", "not-a-number"], ExitCode.BAD_INPUT),
    (["retire", "r1", "1", "--address", "{dead}"], ExitCode.UNAVAILABLE),
    (["resume", "--address", "{dead}"], ExitCode.UNAVAILABLE),
    (["forget"], ExitCode.BAD_INPUT),
    (["forget", "r1", "--address", "{dead}"], ExitCode.UNAVAILABLE),
    (["collect", "--address", "{dead}"], ExitCode.UNAVAILABLE),
    (["ack", "{root}/no-such-file.json"], ExitCode.NOT_FOUND),
    (["inspect", "relative/dir"], ExitCode.BAD_INPUT),
    (["inspect", "{root}/missing"], ExitCode.NOT_FOUND),
    (["inspect", "{root}"], ExitCode.BAD_INPUT),  # a root, not a checkpoint
    (["list", "{ckpt}"], ExitCode.BAD_INPUT),  # a checkpoint, not a root
    (["list", "{root}/missing"], ExitCode.NOT_FOUND),
    (["list", "s4://bucket/x"], ExitCode.BAD_INPUT),
    (["gc", "{root}", "--keep", "0"], ExitCode.BAD_INPUT),
    (["gc", "{ckpt}", "--keep", "1"], ExitCode.BAD_INPUT),
    (["demo", "--rollouts", "0"], ExitCode.BAD_INPUT),
    (["demo", "--checkpoint-dir", "relative/dir"], ExitCode.BAD_INPUT),
    (["demo", "--resume", "latest"], ExitCode.BAD_INPUT),  # no --checkpoint-dir
    (["demo", "--address", "{dead}"], ExitCode.UNAVAILABLE),
]


def _fill(args: list[str], places: dict[str, str]) -> list[str]:
    return [a.format(**places) for a in args]


def _one_error_line(result: Any) -> str:
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    assert "Warning" not in result.output
    return str(lines[0])


@pytest.mark.parametrize(("args", "code"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line_and_its_exit_code(
    args: list[str], code: ExitCode, places: dict[str, str]
) -> None:
    result = run(*_fill(args, places))
    assert result.exit_code == code, result.output
    line = _one_error_line(result)
    assert line.startswith(f"error ({code.label}): "), line
    assert result.stdout == ""
    # The line says what to do after what went wrong.
    assert "; " in line


def test_every_command_refuses_an_unknown_option_in_one_line() -> None:
    """Whatever commands the group has (others add theirs): click's own usage
    errors are one line and exit 2 too."""
    for name in sorted(main.commands):
        result = run(name, "--no-such-option")
        assert result.exit_code == ExitCode.BAD_INPUT, (name, result.output)
        assert _one_error_line(result).startswith("error (bad input): "), name


@pytest.mark.parametrize("body", ["", "[]", "not json", '{"receipts": []}'])
def test_an_empty_ack_is_bad_input_before_any_cluster(body: str, places: dict[str, str]) -> None:
    result = run("ack", "-", "--address", places["dead"], input_=body)
    assert result.exit_code == ExitCode.BAD_INPUT, result.output
    assert "Ray" not in _one_error_line(result)  # refused before attaching
    if not body:
        assert "is empty" in _one_error_line(result)  # says what was wrong, not a decode error


def test_json_errors_keep_the_wire_body_on_stdout(places: dict[str, str]) -> None:
    result = run("status", "--address", places["dead"], "--json")
    assert result.exit_code == ExitCode.UNAVAILABLE
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "unavailable"
    assert error["exit_code"] == 5
    assert places["dead"] in error["detail"]
    _one_error_line(result)


def test_every_reason_has_an_exit_class() -> None:
    assert set(EXIT_BY_REASON) == set(Reason)
    assert all(code is not ExitCode.OK for code in EXIT_BY_REASON.values())


def test_a_coordination_failure_is_one_line_naming_each_participant() -> None:
    exc = CoordinationFailed(
        "commit failed",
        operation="commit",
        failures={
            "model/m": {"code": "invalid_request", "detail": "needs\na scope"},
            "env/e": {"code": "invalid_request", "detail": "x"},
        },
    )
    line = error_line(exc)
    assert "\n" not in line
    assert "model/m: invalid_request: needs a scope" in line and "env/e" in line
    assert exit_code_of(exc) is ExitCode.BAD_INPUT  # every participant said bad input
    mixed = CoordinationFailed(
        "x", failures={"a": {"code": "not_fresh"}, "b": {"code": "deadline_exceeded"}}
    )
    assert exit_code_of(mixed) is ExitCode.UNAVAILABLE


def _cli(*args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **(extra_env or {})}
    env.pop("RAY_CKPT_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-c", "from coordination.demo.app import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_no_ray_fails_fast_in_one_line_and_debug_shows_the_traceback(
    places: dict[str, str],
) -> None:
    """A real process: nothing else (Ray's logging, warnings) reaches stderr."""
    out = _cli("status", "--address", places["dead"])
    assert out.returncode == ExitCode.UNAVAILABLE, out.stderr
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("error (unavailable): Ray is not reachable")
    assert "ray start --head" in out.stderr
    debug = _cli("--debug", "status", "--address", places["dead"])
    assert debug.returncode == ExitCode.UNAVAILABLE
    assert "Traceback" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1].startswith("error (unavailable): ")


def test_an_unconfigured_store_is_refused_before_the_demos_first_run(
    tmp_path: pathlib.Path,
) -> None:
    """s3:// with an endpoint nothing answers at: found up front (no Ray
    started), in one line naming the variables to set."""
    out = _cli(
        "demo",
        "--checkpoint-dir",
        "s3://bucket/run",
        extra_env={
            "AWS_ENDPOINT_URL": f"http://{_dead_address()}",
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "x",
            "AWS_SECRET_ACCESS_KEY": "y",
            "RAY_ADDRESS": _dead_address(),  # a demo that went on would fail otherwise
        },
    )
    assert out.returncode == ExitCode.BAD_INPUT, out.stderr[-2000:]
    assert out.stderr.count("\n") == 1, out.stderr
    assert "s3://bucket/run" in out.stderr
    assert "AWS_ENDPOINT_URL" in out.stderr
    assert out.stdout == ""


def test_python_m_demo_is_one_line_too(places: dict[str, str]) -> None:
    """`python -m coordination.demo` (as `ray job submit` runs it) has no group
    around it: its errors are one line all the same."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    out = subprocess.run(
        [sys.executable, "-m", "coordination.demo", "--address", places["dead"]],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == ExitCode.UNAVAILABLE, out.stderr[-2000:]
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("error (unavailable): ")
