"""Capture: content-addressed, incremental, and refusing what a snapshot
cannot carry without changing anything."""

from __future__ import annotations

import asyncio
import os
import pathlib
import socket

import blake3
import pytest

from ray_ckpt.errors import (
    SandboxFileTooLarge,
    SandboxPathEscape,
    SandboxRefused,
    SandboxSpecialFile,
)
from ray_ckpt.sandbox import DirectorySandbox, SandboxHandle
from tests.unit.sandbox.trees import stored

# A file's timestamps advance in ticks (at most 10 ms on Linux); a capture
# re-reads a file changed in its own tick (the "racily clean" guard).  The
# tests that count copied bytes wait this long after writing, so no file is
# in that tick by accident.
PAST_THE_TICK_S = 0.05


def _digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


async def _twenty(provider: DirectorySandbox) -> tuple[SandboxHandle, list[bytes]]:
    h = await provider.create("r1")
    contents = [os.urandom(1000 + i) for i in range(20)]
    for i, data in enumerate(contents):
        await provider.write_file(h, f"d{i % 3}/f{i}.bin", data)
    await asyncio.sleep(PAST_THE_TICK_S)
    return h, contents


async def test_a_second_capture_copies_only_the_one_changed_file(
    provider: DirectorySandbox, root: pathlib.Path
) -> None:
    h, contents = await _twenty(provider)
    first = await provider.capture(h)
    assert first.copied_bytes == sum(len(c) for c in contents)
    assert stored(root) == {_digest(c) for c in contents}

    changed = os.urandom(len(contents[7]))
    await provider.write_file(h, "d1/f7.bin", changed)
    await asyncio.sleep(PAST_THE_TICK_S)
    second = await provider.capture(h)
    assert second.copied_bytes == len(changed)
    # The earlier content stays: the first capture's attachments are immutable
    # until the sandbox is freed (an asynchronous commit may still read them).
    assert stored(root) == {_digest(c) for c in contents} | {_digest(changed)}
    entry = {e.path: e for e in second.snapshot.entries}["d1/f7.bin"]
    assert (entry.digest, entry.size) == (_digest(changed), len(changed))
    assert pathlib.Path(second.attachments[_digest(changed)]).read_bytes() == changed

    await asyncio.sleep(PAST_THE_TICK_S)
    third = await provider.capture(h)
    assert third.copied_bytes == 0
    assert third.snapshot == second.snapshot


async def test_identical_contents_are_stored_once_read_only(
    provider: DirectorySandbox, root: pathlib.Path
) -> None:
    h = await provider.create("r1")
    same = os.urandom(4096)
    for i in range(5):
        await provider.write_file(h, f"copy{i}", same)
    await provider.write_file(h, "other", b"other")
    captured = await provider.capture(h)
    assert stored(root) == {_digest(same), _digest(b"other")}
    assert {e.digest for e in captured.snapshot.entries} == {_digest(same), _digest(b"other")}
    assert captured.snapshot.bytes() == len(same) + len(b"other")
    path = pathlib.Path(captured.attachments[_digest(same)])
    assert path.stat().st_mode & 0o777 == 0o444


async def test_a_file_rewritten_in_place_at_the_same_size_is_seen(
    provider: DirectorySandbox,
) -> None:
    """Rewritten right after a capture, in place, same size: maybe in the
    same timestamp tick; the capture must read it again, never trust it."""
    h = await provider.create("r1")
    path = provider.directory(h) / "f"
    for i in range(20):
        path.write_bytes(b"%04d" % i)
        await provider.capture(h)
        with open(path, "r+b") as f:  # same inode, same size
            f.write(b"X%03d" % i)
        captured = await provider.capture(h)
        [entry] = captured.snapshot.entries
        assert entry.digest == _digest(b"X%03d" % i), i


async def test_a_capture_after_a_restore_copies_what_the_store_lacks(
    provider: DirectorySandbox, root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    h, contents = await _twenty(provider)
    captured = await provider.capture(h)
    # The attachments as a checkpoint holds them; the provider forgets its own.
    copies = tmp_path / "copies"
    copies.mkdir()
    attachments = {}
    for digest, path in captured.attachments.items():
        (copies / digest).write_bytes(pathlib.Path(path).read_bytes())
        attachments[digest] = str(copies / digest)
    await provider.free(h)
    await provider.capture(await provider.create("sweeper"))  # sweeps the freed contents
    assert stored(root) == set()

    [h1] = await provider.restore([(captured.snapshot, attachments)])
    assert stored(root) == set()  # a restore copies nothing into the store
    await asyncio.sleep(PAST_THE_TICK_S)
    again = await provider.capture(h1)
    assert again.copied_bytes == sum(len(c) for c in contents)
    assert stored(root) == {_digest(c) for c in contents}
    await asyncio.sleep(PAST_THE_TICK_S)
    assert (await provider.capture(h1)).copied_bytes == 0


async def _refused_changes_nothing(
    provider: DirectorySandbox,
    root: pathlib.Path,
    h: SandboxHandle,
    error: type[SandboxRefused],
    bad: pathlib.Path,
) -> None:
    """The capture is refused, the store unchanged; once the bad path is gone
    the next capture copies only what changed since the last good one."""
    before = stored(root)
    await provider.write_file(h, "new.txt", b"written after the good capture")
    with pytest.raises(error):
        await provider.capture(h)
    assert stored(root) == before
    bad.unlink()
    await asyncio.sleep(PAST_THE_TICK_S)
    after = await provider.capture(h)
    assert after.copied_bytes == len(b"written after the good capture")
    assert "new.txt" in {e.path for e in after.snapshot.entries}


@pytest.mark.parametrize("target", ["../../outside", "/etc/passwd", "a/../../../x"])
async def test_a_symlink_leading_outside_is_refused(
    provider: DirectorySandbox, root: pathlib.Path, target: str
) -> None:
    h, _ = await _twenty(provider)
    await provider.capture(h)
    link = provider.directory(h) / "d0" / "escape"
    os.symlink(target, link)
    await _refused_changes_nothing(provider, root, h, SandboxPathEscape, link)


async def test_a_symlink_through_a_link_to_the_root_is_refused(
    provider: DirectorySandbox, root: pathlib.Path
) -> None:
    """`up -> .` then `x -> up/../secret`: lexically inside, outside in fact."""
    h, _ = await _twenty(provider)
    await provider.capture(h)
    tree = provider.directory(h)
    os.symlink(".", tree / "up")
    os.symlink("up/../outside", tree / "x")
    await _refused_changes_nothing(provider, root, h, SandboxPathEscape, tree / "x")


async def test_a_fifo_is_refused(provider: DirectorySandbox, root: pathlib.Path) -> None:
    h, _ = await _twenty(provider)
    await provider.capture(h)
    fifo = provider.directory(h) / "d2" / "pipe"
    os.mkfifo(fifo)
    await _refused_changes_nothing(provider, root, h, SandboxSpecialFile, fifo)


async def test_a_socket_file_is_refused(provider: DirectorySandbox, root: pathlib.Path) -> None:
    h, _ = await _twenty(provider)
    await provider.capture(h)
    path = provider.directory(h) / "sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
        await _refused_changes_nothing(provider, root, h, SandboxSpecialFile, path)


async def test_a_file_over_the_bound_is_refused(
    provider: DirectorySandbox, root: pathlib.Path
) -> None:
    h, _ = await _twenty(provider)
    await provider.capture(h)
    big = provider.directory(h) / "big.bin"
    big.write_bytes(b"\0" * (provider.max_file_bytes + 1))
    await _refused_changes_nothing(provider, root, h, SandboxFileTooLarge, big)


async def test_live_is_reported_for_a_process_running_at_the_capture(
    provider: DirectorySandbox,
) -> None:
    h = await provider.create("r1")
    bg = await provider.run(h, ["sleep", "30"], timeout_s=60, background=True)
    assert bg.pid is not None
    assert (await provider.capture(h)).live is True
    await provider.free(h)
    h2 = await provider.create("r2")
    assert (await provider.capture(h2)).live is False


async def test_concurrent_captures_and_frees_never_hand_out_a_deleted_file(
    provider: DirectorySandbox, root: pathlib.Path
) -> None:
    """Sandboxes sharing contents, captured while others holding the same
    contents are freed: every attachment handed out exists afterwards."""
    shared = [os.urandom(50_000) for _ in range(10)]
    handles = []
    for n in range(6):
        h = await provider.create(f"r{n}")
        for i, data in enumerate(shared):
            await provider.write_file(h, f"f{i}", data)
        handles.append(h)
    doomed, kept = handles[:3], handles[3:]
    await asyncio.gather(*(provider.capture(h) for h in doomed))
    results = await asyncio.gather(
        *(provider.capture(h) for h in kept), *(provider.free(h) for h in doomed)
    )
    for captured in results[: len(kept)]:
        assert captured is not None
        for path in captured.attachments.values():
            assert pathlib.Path(path).is_file()
    assert stored(root) == {_digest(d) for d in shared}


async def test_a_cancelled_capture_leaves_nothing_once_freed_and_swept(
    provider: DirectorySandbox, root: pathlib.Path
) -> None:
    h = await provider.create("r1")
    for i in range(40):
        await provider.write_file(h, f"f{i}", os.urandom(200_000))
    task = asyncio.create_task(provider.capture(h))
    await asyncio.sleep(0.001)  # its thread is copying
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await provider.free(h)  # waits for the thread, then releases what it stored
    await provider.capture(await provider.create("sweeper"))  # which goes at the next capture
    assert stored(root) == set()
    assert list((root / "cas").iterdir()) == []
