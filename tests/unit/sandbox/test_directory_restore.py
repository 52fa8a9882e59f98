"""Restore: every sandbox of the call or none; the old generation fenced;
free stops processes, removes the tree and the contents nobody holds."""

from __future__ import annotations

import asyncio
import pathlib
import shutil
from collections.abc import Awaitable, Callable

import blake3
import msgspec
import pytest

from ray_ckpt.errors import (
    InvalidCheckpointState,
    SandboxFenced,
    SandboxFileTooLarge,
    SandboxPathEscape,
    SandboxRefused,
)
from ray_ckpt.sandbox import (
    Captured,
    DirectorySandbox,
    SandboxHandle,
    SandboxSnapshot,
    SnapshotEntry,
)
from tests.unit.helpers import until
from tests.unit.sandbox.trees import listing, stored, trees


async def _episode(provider: DirectorySandbox, owner: str, files: int) -> SandboxHandle:
    h = await provider.create(owner)
    for i in range(files):
        await provider.write_file(h, f"src/{owner}-{i}.txt", f"{owner} file {i}\n".encode())
    await provider.write_file(h, "shared.txt", b"the same in every sandbox")
    return h


def _copies(captured: Captured, into: pathlib.Path) -> dict[str, str]:
    """The attachments as a checkpoint's local copies."""
    into.mkdir(parents=True, exist_ok=True)
    return {d: shutil.copy(p, into / d) for d, p in captured.attachments.items()}


async def test_a_corrupted_attachment_restores_nothing_and_the_old_ones_still_work(
    provider: DirectorySandbox, root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    a = await _episode(provider, "ra", 3)
    b = await _episode(provider, "rb", 3)
    ca, cb = await provider.capture(a), await provider.capture(b)
    good_a = _copies(ca, tmp_path / "a")
    bad_b = _copies(cb, tmp_path / "b")
    victim = next(e for e in cb.snapshot.entries if e.path == "src/rb-1.txt")
    assert victim.digest is not None
    data = bytearray(pathlib.Path(bad_b[victim.digest]).read_bytes())
    data[0] ^= 0xFF  # same size, other bytes
    pathlib.Path(bad_b[victim.digest]).write_bytes(bytes(data))
    before = trees(root)

    with pytest.raises(InvalidCheckpointState, match=r"src/rb-1\.txt"):
        await provider.restore([(ca.snapshot, good_a), (cb.snapshot, bad_b)])
    assert trees(root) == before  # no tree for either, no temporary left
    for h, name in ((a, "ra"), (b, "rb")):  # nothing fenced
        await provider.write_file(h, "after.txt", b"still mine")
        assert (await provider.run(h, ["cat", f"src/{name}-0.txt"], timeout_s=10)).exit_code == 0
        await provider.capture(h)


async def test_a_missing_attachment_file_restores_nothing(
    provider: DirectorySandbox, root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    a = await _episode(provider, "ra", 2)
    b = await _episode(provider, "rb", 2)
    ca, cb = await provider.capture(a), await provider.capture(b)
    copies_b = _copies(cb, tmp_path / "b")
    pathlib.Path(next(iter(copies_b.values()))).unlink()
    before = trees(root)
    with pytest.raises(InvalidCheckpointState, match="cannot be read"):
        await provider.restore(
            [(ca.snapshot, _copies(ca, tmp_path / "a")), (cb.snapshot, copies_b)]
        )
    assert trees(root) == before


def _with(snapshot: SandboxSnapshot, *entries: SnapshotEntry) -> SandboxSnapshot:
    return msgspec.structs.replace(snapshot, entries=[*snapshot.entries, *entries])


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        (SnapshotEntry("../x", "dir", 0o755), SandboxPathEscape),
        (SnapshotEntry("/abs", "dir", 0o755), SandboxPathEscape),
        (SnapshotEntry("ln", "symlink", 0o777, target="/etc"), SandboxPathEscape),
        (SnapshotEntry("ln", "symlink", 0o777, target="../../.."), SandboxPathEscape),
        (SnapshotEntry("a//b", "dir", 0o755), InvalidCheckpointState),
        (SnapshotEntry("nodir/f", "dir", 0o755), InvalidCheckpointState),
        (SnapshotEntry("shared.txt", "dir", 0o755), InvalidCheckpointState),  # twice
        (SnapshotEntry("f", "file", 0o644, size=3, digest="ab" * 32), InvalidCheckpointState),
        (SnapshotEntry("f", "file", 0o644, size=1 << 30, digest="ab" * 32), SandboxFileTooLarge),
    ],
)
async def test_a_bad_snapshot_is_refused_and_leaves_no_tree(
    provider: DirectorySandbox,
    root: pathlib.Path,
    entry: SnapshotEntry,
    error: type[Exception],
) -> None:
    a = await _episode(provider, "ra", 1)
    b = await _episode(provider, "rb", 1)
    ca, cb = await provider.capture(a), await provider.capture(b)
    attachments = {**cb.attachments, "ab" * 32: cb.attachments[next(iter(cb.attachments))]}
    before = trees(root)
    with pytest.raises(error):
        await provider.restore(
            [(ca.snapshot, ca.attachments), (_with(cb.snapshot, entry), attachments)]
        )
    assert trees(root) == before


async def test_a_snapshot_of_another_provider_is_refused(provider: DirectorySandbox) -> None:
    a = await _episode(provider, "ra", 1)
    ca = await provider.capture(a)
    for other in (
        msgspec.structs.replace(ca.snapshot, provider="hosted"),
        msgspec.structs.replace(ca.snapshot, sandbox_id="../../etc"),
    ):
        with pytest.raises((InvalidCheckpointState, SandboxRefused)):
            await provider.restore([(other, ca.attachments)])


Call = Callable[[SandboxHandle], Awaitable[object]]


async def test_after_a_restore_the_old_generation_is_fenced_and_freed_when_retired(
    provider: DirectorySandbox, root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    old = await _episode(provider, "ra", 2)
    bg = await provider.run(old, ["sleep", "30"], timeout_s=60, background=True)
    captured = await provider.capture(old)
    [new] = await provider.restore([(captured.snapshot, _copies(captured, tmp_path / "c"))])
    assert (new.sandbox_id, new.generation) == (old.sandbox_id, 1)
    assert listing(provider.directory(new)) == listing(root / "trees" / f"{old.sandbox_id}.g0")

    calls: dict[str, Call] = {
        "run": lambda h: provider.run(h, ["true"], timeout_s=10),
        "write_file": lambda h: provider.write_file(h, "x", b"x"),
        "read_file": lambda h: provider.read_file(h, "shared.txt"),
        "capture": lambda h: provider.capture(h),
        "directory": lambda h: _sync(provider.directory, h),
    }
    for call in calls.values():
        with pytest.raises(SandboxFenced, match="fenced"):
            await call(old)
        await call(new)  # the new generation serves
    # Fenced is not freed: its process runs on until its attempt is retired.
    assert provider.alive(old) is True
    assert f"{old.sandbox_id}.g0" in trees(root)

    await provider.free(old)
    assert bg.pid is not None
    assert provider.alive(old) is False
    assert f"{old.sandbox_id}.g0" not in trees(root)
    with pytest.raises(SandboxFenced, match="freed"):
        await provider.run(old, ["true"], timeout_s=10)
    await provider.free(old)  # idempotent
    # A restore of the same snapshot again makes a newer generation, never a twin.
    [newer] = await provider.restore([(captured.snapshot, _copies(captured, tmp_path / "d"))])
    assert newer.generation == 2
    with pytest.raises(SandboxFenced):
        await provider.read_file(new, "shared.txt")


def _digest_of(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


async def _sync(fn: Callable[[SandboxHandle], object], h: SandboxHandle) -> object:
    return fn(h)


async def test_free_removes_the_tree_and_only_the_contents_nobody_else_holds(
    provider: DirectorySandbox, root: pathlib.Path
) -> None:
    a = await _episode(provider, "ra", 2)
    b = await _episode(provider, "rb", 2)
    ca, cb = await provider.capture(a), await provider.capture(b)
    await provider.write_file(a, "src/ra-0.txt", b"a second version")
    ca2 = await provider.capture(a)
    assert stored(root) == ca.snapshot.digests() | ca2.snapshot.digests() | cb.snapshot.digests()
    bg = await provider.run(a, ["sleep", "30"], timeout_s=60, background=True)
    assert bg.pid is not None

    await provider.free(a)
    assert provider.alive(a) is False
    assert f"{a.sandbox_id}.g0" not in trees(root)
    # a's contents wait for the next capture (a commit's write may still read
    # them); that capture deletes every version a's captures handed out, but
    # the content b holds too stays.
    await provider.capture(b)
    assert stored(root) == cb.snapshot.digests()
    for path in cb.attachments.values():
        assert pathlib.Path(path).is_file()

    await provider.free(b)
    await provider.close()
    assert stored(root) == set()
    assert trees(root) == set()


async def test_a_freed_sandbox_s_attachments_outlive_it_until_the_next_capture(
    provider: DirectorySandbox, root: pathlib.Path
) -> None:
    """An asynchronous commit writes a capture's attachments after the resume,
    while the episode runs on: its finishing (the sandbox freed) must not
    delete a file the write has still to read.  The engine's next capture
    comes only after that write ended, so it may sweep them."""
    a = await _episode(provider, "ra", 3)
    other = await provider.create("rb")
    captured = await provider.capture(a)
    await provider.free(a)
    for digest, path in captured.attachments.items():
        assert _digest_of(pathlib.Path(path).read_bytes()) == digest  # the write reads them
    await provider.capture(other)
    assert stored(root) == set()
    assert not any(pathlib.Path(p).exists() for p in captured.attachments.values())


async def test_free_removes_a_tree_the_sandbox_made_read_only(
    provider: DirectorySandbox, root: pathlib.Path
) -> None:
    h = await _episode(provider, "ra", 2)
    result = await provider.run(h, ["chmod", "-R", "a-w", "."], timeout_s=10)
    assert result.exit_code == 0
    await provider.run(h, ["chmod", "000", "src"], timeout_s=10)
    await provider.free(h)
    assert trees(root) == set()


async def test_a_cancelled_restore_installs_nothing_and_its_trees_go(
    provider: DirectorySandbox, root: pathlib.Path
) -> None:
    h = await provider.create("r1")
    for i in range(40):
        await provider.write_file(h, f"f{i}", b"%d" % i * 100_000)
    captured = await provider.capture(h)
    before = trees(root)
    task = asyncio.create_task(provider.restore([(captured.snapshot, captured.attachments)]))
    await asyncio.sleep(0.001)  # its thread is building
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: trees(root) == before, timeout=10)
    await provider.write_file(h, "still", b"served")  # the old generation is not fenced


async def test_a_free_called_twice_at_once_returns_freed_both_times(
    provider: DirectorySandbox, root: pathlib.Path
) -> None:
    h = await _episode(provider, "ra", 2)
    bg = await provider.run(h, ["sleep", "30"], timeout_s=60, background=True)
    first = asyncio.create_task(provider.free(h))
    await asyncio.sleep(0)
    first.cancel()  # the caller gives up; the freeing does not
    await provider.free(h)  # waits for the one under way
    assert trees(root) == set()
    assert bg.pid is not None
    assert not provider.alive(h)
    await asyncio.gather(first, return_exceptions=True)
