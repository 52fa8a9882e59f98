"""The ray-ckpt commands that need no cluster."""

from __future__ import annotations

import pathlib

from click.testing import CliRunner

from coordination.cli import main


def test_inspect_of_a_missing_checkpoint_fails_and_says_why(tmp_path: pathlib.Path) -> None:
    result = CliRunner().invoke(main, ["inspect", str(tmp_path), "--json"])
    assert result.exit_code == 1
    assert '"ok":false' in result.output


def test_every_command_is_listed() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for name in ("status", "checkpoint", "restore", "retire", "inspect", "demo"):
        assert name in result.output
