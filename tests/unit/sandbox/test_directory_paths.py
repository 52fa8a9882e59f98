"""Paths named to write_file and read_file: relative, no `..`, no symlink
leading outside, within the size bound; a refusal changes nothing."""

from __future__ import annotations

import os
import pathlib

import pytest

from ray_ckpt.errors import (
    SandboxFileTooLarge,
    SandboxPathEscape,
    SandboxRefused,
    SandboxSpecialFile,
)
from ray_ckpt.sandbox import DirectorySandbox
from ray_ckpt.sandbox.paths import relative
from tests.unit.sandbox.trees import listing


@pytest.mark.parametrize(
    ("path", "normal"),
    [("a", "a"), ("./a//b/", "a/b"), ("a/./b", "a/b"), (".", ""), ("", "")],
)
def test_paths_are_normalized(path: str, normal: str) -> None:
    assert relative(path) == normal


@pytest.mark.parametrize("path", ["..", "../x", "a/../../x", "a/..", "/etc/passwd", "/"])
async def test_write_refuses_dotdot_and_absolute_paths_changing_nothing(
    provider: DirectorySandbox, tmp_path: pathlib.Path, path: str
) -> None:
    h = await provider.create("r1")
    await provider.write_file(h, "keep.txt", b"kept")
    before = listing(tmp_path)
    with pytest.raises(SandboxPathEscape):
        await provider.write_file(h, path, b"x")
    with pytest.raises(SandboxPathEscape):
        await provider.read_file(h, path)
    assert listing(tmp_path) == before


async def test_a_parent_symlink_leading_outside_is_refused(
    provider: DirectorySandbox, tmp_path: pathlib.Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"untouched")
    h = await provider.create("r1")
    os.symlink(outside, provider.directory(h) / "out")  # absolute
    os.symlink("../../..", provider.directory(h) / "up")  # relative, to the root's parent
    before = listing(tmp_path)
    for path in ("out/victim", "out/new/file", "up/outside/victim"):
        with pytest.raises(SandboxPathEscape):
            await provider.write_file(h, path, b"x")
        with pytest.raises(SandboxPathEscape):
            await provider.read_file(h, path)
    assert listing(tmp_path) == before
    # A symlink inside is followed: the write lands on its target.
    await provider.write_file(h, "real/f", b"1")
    os.symlink("real", provider.directory(h) / "alias")
    await provider.write_file(h, "alias/f", b"2")
    assert (provider.directory(h) / "real" / "f").read_bytes() == b"2"


async def test_a_write_over_the_bound_is_refused_changing_nothing(
    provider: DirectorySandbox, tmp_path: pathlib.Path
) -> None:
    h = await provider.create("r1")
    before = listing(tmp_path)
    with pytest.raises(SandboxFileTooLarge):
        await provider.write_file(h, "new/dir/big", b"\0" * (provider.max_file_bytes + 1))
    assert listing(tmp_path) == before  # not even its parent directories
    await provider.write_file(h, "ok", b"\0" * provider.max_file_bytes)


async def test_a_read_of_a_file_over_the_bound_or_special_is_refused(
    provider: DirectorySandbox,
) -> None:
    h = await provider.create("r1")
    tree = provider.directory(h)
    (tree / "big").write_bytes(b"\0" * (provider.max_file_bytes + 1))
    os.mkfifo(tree / "fifo")
    with pytest.raises(SandboxFileTooLarge):
        await provider.read_file(h, "big")
    with pytest.raises(SandboxSpecialFile):
        await provider.read_file(h, "fifo")  # refused, never blocks on the pipe


async def test_writes_refuse_a_directory_a_file_parent_and_bad_modes(
    provider: DirectorySandbox, tmp_path: pathlib.Path
) -> None:
    h = await provider.create("r1")
    await provider.write_file(h, "plain", b"x")
    await provider.write_file(h, "dir/f", b"x")
    before = listing(tmp_path)
    with pytest.raises(SandboxRefused, match="not a directory"):
        await provider.write_file(h, "plain/below/f", b"x")
    with pytest.raises(SandboxRefused, match="is a directory"):
        await provider.write_file(h, "dir", b"x")
    with pytest.raises(SandboxRefused, match="itself"):
        await provider.write_file(h, ".", b"x")
    with pytest.raises(SandboxRefused, match="permission bits"):
        await provider.write_file(h, "f", b"x", mode=0o10000)
    assert listing(tmp_path) == before


async def test_create_refuses_an_owner_that_is_no_name_and_a_cwd_outside(
    provider: DirectorySandbox,
) -> None:
    for owner in ("../x", "a/b", "", ".hidden"):
        with pytest.raises(SandboxRefused):
            await provider.create(owner)
    with pytest.raises(SandboxPathEscape):
        await provider.create("r1", cwd="../elsewhere")
