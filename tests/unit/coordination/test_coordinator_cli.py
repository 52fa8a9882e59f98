"""The ray-ckpt commands that need no cluster."""

from __future__ import annotations

import pathlib

import pytest
from click.testing import CliRunner

from coordination.demo.app import main  # the `ray-ckpt` command: the library CLI and the demo


def test_inspect_of_a_missing_checkpoint_fails_and_says_why(tmp_path: pathlib.Path) -> None:
    result = CliRunner().invoke(main, ["inspect", str(tmp_path), "--json"])
    assert result.exit_code == 1  # an empty directory: there, but no checkpoint
    assert '"ok":false' in result.stdout


def test_every_command_is_listed() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for name in ("status", "checkpoint", "restore", "retire", "inspect", "demo"):
        assert name in result.output


def test_version_is_the_installed_packages() -> None:
    from importlib.metadata import version

    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"ray-ckpt, version {version('ray-ckpt')}"


def test_demo_help_shows_the_demos_own_options() -> None:
    result = CliRunner().invoke(main, ["demo", "--help"])
    assert result.exit_code == 0
    assert "Usage: ray-ckpt demo" in result.output
    for option in ("--rollouts", "--steps", "--checkpoint-dir", "--json", "--address"):
        assert option in result.output


class _Handle:
    """Stands in for the cluster's coordinator: records what `restore` was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, list[str], bool]] = []

    def restore(
        self, directory: str, keys: list[str], *, allow_without_gym_manifest: bool = False
    ) -> object:
        from coordination.engine.results import RestoreResult

        self.asked.append((directory, keys, allow_without_gym_manifest))
        return RestoreResult(
            checkpoint_id="restore-1",
            source_checkpoint_id="ckpt-1",
            checkpoint_dir=directory,
            total_s=0.0,
            timings={},
            restored={},
            resumed=True,
        )


def test_restore_without_gym_manifest_is_asked_for_explicitly(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import coordination.cli.commands as cli

    handle = _Handle()
    monkeypatch.setattr(cli, "_connect", lambda address, namespace: handle)
    for flags, allowed in (([], False), (["--without-gym-manifest"], True)):
        result = CliRunner().invoke(
            main, ["restore", str(tmp_path), "--episode", "r0", "--namespace", "n", *flags]
        )
        assert result.exit_code == 0, result.output
        assert handle.asked[-1] == (str(tmp_path), ["r0"], allowed)
