"""The provider contract against `DirectorySandbox`: create, write, run,
capture and restore give back the same files, modes, symlinks, empty
directories, working directory and environment."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import msgspec
import pytest

from ray_ckpt.errors import NotFound, SandboxFenced, SandboxRefused
from ray_ckpt.sandbox import (
    DirectorySandbox,
    SandboxCapability,
    SandboxHandle,
    SandboxProvider,
    SandboxSnapshot,
)
from tests.unit.sandbox.trees import listing, stored, trees


async def _populate(provider: DirectorySandbox) -> tuple[SandboxHandle, pathlib.Path]:
    h = await provider.create("r1", cwd="work", env={"PATH": "/usr/bin:/bin", "ANSWER": "42"})
    await provider.write_file(h, "work/run.sh", b"#!/bin/sh\necho ran\n", mode=0o755)
    await provider.write_file(h, "secret.txt", b"s3cret", mode=0o600)
    await provider.write_file(h, "a/b/c.txt", b"deep")
    await provider.write_file(h, "a/b/same.txt", b"deep")  # the same content twice
    for argv in (
        ["ln", "-s", "../secret.txt", "link"],  # relative, from cwd "work"
        ["ln", "-s", "b/c.txt", "../a/rel"],
        ["mkdir", "-p", "../empty/deeper"],
        ["chmod", "750", "../a"],
    ):
        result = await provider.run(h, argv, timeout_s=10)
        assert result.exit_code == 0, result.stderr
    return h, provider.directory(h)


def test_directory_sandbox_satisfies_the_protocol(provider: DirectorySandbox) -> None:
    assert isinstance(provider, SandboxProvider)
    assert provider.capability is SandboxCapability.FILESYSTEM
    assert provider.name == "directory"


async def test_capture_then_restore_gives_back_files_modes_links_dirs_cwd_and_env(
    provider: DirectorySandbox,
) -> None:
    h, tree = await _populate(provider)
    captured = await provider.capture(h)
    snap = captured.snapshot
    assert (snap.provider, snap.capability, snap.generation) == ("directory", "filesystem", 0)
    assert (snap.cwd, snap.env) == ("work", {"PATH": "/usr/bin:/bin", "ANSWER": "42"})
    assert captured.live is False
    kinds = {e.path: e.kind for e in snap.entries}
    assert kinds == {
        "a": "dir",
        "a/b": "dir",
        "a/b/c.txt": "file",
        "a/b/same.txt": "file",
        "a/rel": "symlink",
        "empty": "dir",
        "empty/deeper": "dir",
        "secret.txt": "file",
        "work": "dir",
        "work/link": "symlink",
        "work/run.sh": "file",
    }
    # Each attachment holds exactly its digest's bytes; equal contents share one.
    assert set(captured.attachments) == snap.digests()
    assert len(snap.digests()) == 3
    # The snapshot travels as plain JSON in a record's state and decodes back equal.
    plain = msgspec.json.decode(msgspec.json.encode(msgspec.to_builtins(snap)))
    assert msgspec.convert(plain, SandboxSnapshot) == snap

    [h1] = await provider.restore([(snap, captured.attachments)])
    assert (h1.sandbox_id, h1.generation) == (h.sandbox_id, 1)
    restored = provider.directory(h1)
    assert restored != tree
    assert listing(restored) == listing(tree)
    pwd = await provider.run(h1, ["pwd"], timeout_s=10)
    assert pwd.stdout.strip() == str((restored / "work").resolve())
    env = await provider.run(h1, ["env"], timeout_s=10)
    assert sorted(env.stdout.split()) == ["ANSWER=42", "PATH=/usr/bin:/bin"]
    ran = await provider.run(h1, ["./run.sh"], timeout_s=10)
    assert (ran.exit_code, ran.stdout) == (0, "ran\n")
    assert await provider.read_file(h1, "work/link") == b"s3cret"


# A server that captures a sandbox, copies its attachments where a checkpoint
# would, and dies without cleaning up (os._exit).
_DYING_SERVER = r"""
import asyncio, os, shutil, sys
import msgspec
from ray_ckpt.sandbox import DirectorySandbox

async def main():
    root, checkpoint = sys.argv[1], sys.argv[2]
    provider = DirectorySandbox(root)
    h = await provider.create("r1", cwd="work", env={"K": "v"})
    await provider.write_file(h, "work/f.txt", b"kept")
    await provider.write_file(h, "bin/tool", b"#!/bin/sh\n", mode=0o700)
    captured = await provider.capture(h)
    copies = {d: shutil.copy(p, os.path.join(checkpoint, d))
              for d, p in captured.attachments.items()}
    with open(os.path.join(checkpoint, "state.json"), "wb") as f:
        f.write(msgspec.json.encode({"snapshot": captured.snapshot, "copies": copies}))
    os._exit(0)

asyncio.run(main())
"""


async def test_a_restarted_server_restores_from_the_checkpoints_copies(
    root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """A new provider over the root a dead server left: what was there is
    removed, and the snapshot comes back from the checkpoint's copies."""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    subprocess.run(
        [sys.executable, "-c", _DYING_SERVER, str(root), str(checkpoint)],
        check=True,
        timeout=60,
        cwd=pathlib.Path(__file__).resolve().parents[3],
    )
    left = trees(root)
    assert len(left) == 1
    assert len(stored(root)) == 2
    state = msgspec.json.decode((checkpoint / "state.json").read_bytes())
    snapshot = msgspec.convert(state["snapshot"], SandboxSnapshot)

    second = DirectorySandbox(root)
    try:
        assert trees(root) == set()
        assert stored(root) == set()
        [h1] = await second.restore([(snapshot, state["copies"])])
        assert h1.generation == 1
        assert listing(second.directory(h1)) == {
            "bin": ("dir", 0o755, None),
            "bin/tool": ("file", 0o700, b"#!/bin/sh\n"),
            "work": ("dir", 0o755, None),
            "work/f.txt": ("file", 0o644, b"kept"),
        }
        env = await second.run(h1, ["/usr/bin/env"], timeout_s=10)
        assert env.stdout == "K=v\n"
        old = SandboxHandle(sandbox_id=snapshot.sandbox_id, generation=0)
        with pytest.raises(SandboxFenced):
            await second.read_file(old, "work/f.txt")  # the dead server's: not this one's
    finally:
        await second.close()


async def test_a_root_in_use_is_refused_until_its_provider_closes(
    provider: DirectorySandbox, root: pathlib.Path
) -> None:
    with pytest.raises(SandboxRefused, match="in use"):
        DirectorySandbox(root)
    await provider.close()
    await DirectorySandbox(root).close()


async def test_run_reports_exit_codes_output_and_missing_programs(
    provider: DirectorySandbox,
) -> None:
    h = await provider.create("r1")
    result = await provider.run(h, ["sh", "-c", "echo out; echo err >&2; exit 3"], timeout_s=10)
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert result.timed_out is False
    missing = await provider.run(h, ["no-such-program-here"], timeout_s=10)
    assert missing.exit_code == 127
    # Output past the bound is read and dropped, never kept.
    small = DirectorySandbox(provider.root + "-small", max_output_bytes=10)
    try:
        hs = await small.create("r1")
        loud = await small.run(hs, [sys.executable, "-c", "print('x' * 200_000)"], timeout_s=20)
        assert (loud.exit_code, loud.stdout) == (0, "x" * 10)
    finally:
        await small.close()


async def test_files_written_are_read_back_and_a_missing_one_is_not_found(
    provider: DirectorySandbox,
) -> None:
    h = await provider.create("r1")
    await provider.write_file(h, "./x//y/z.bin", bytes(range(256)), mode=0o640)
    assert await provider.read_file(h, "x/y/z.bin") == bytes(range(256))
    assert (provider.directory(h) / "x/y/z.bin").stat().st_mode & 0o7777 == 0o640
    await provider.write_file(h, "x/y/z.bin", b"new")  # replaced whole
    assert await provider.read_file(h, "x/y/z.bin") == b"new"
    with pytest.raises(NotFound):
        await provider.read_file(h, "x/nothing")


async def test_two_sandboxes_of_one_owner_are_distinct(provider: DirectorySandbox) -> None:
    a = await provider.create("r1")
    b = await provider.create("r1")
    assert a != b
    assert a.sandbox_id.startswith("r1-")
    await provider.write_file(a, "f", b"a")
    with pytest.raises(NotFound):
        await provider.read_file(b, "f")
