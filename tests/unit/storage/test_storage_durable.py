"""Durable writes: WriteStop, fsync errors, and a crash between every step."""

from __future__ import annotations

import errno
import os
import pathlib
import threading
from collections.abc import Iterator

import pytest

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage import (
    WriteStop,
    participant_dir,
    read_gym_manifest,
    read_participant,
    verify_checkpoint,
    write_gym_manifest,
    write_participant,
)
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.root.gym_manifest import gym_manifest_path

KIND, INST = "agent", "a0"


def recs(tag: str = "x") -> list[Record]:
    return [Record(f"r{i}", {"tag": tag, "i": i, "pad": "p" * 5000}) for i in range(4)]


def write(d: pathlib.Path, stop: WriteStop | None = None, cid: str = "c1", records=None):  # type: ignore[no-untyped-def]
    return write_participant(
        d, kind=KIND, instance=INST, checkpoint_id=cid, records=records or recs(), stop=stop
    )


def leftovers(d: pathlib.Path) -> list[str]:
    pd = participant_dir(d, KIND, INST)
    return sorted(p.name for p in pd.iterdir()) if pd.exists() else []


def test_stop_before_the_write_publishes_nothing(tmp_path: pathlib.Path) -> None:
    stop = WriteStop()
    stop.stop()
    assert stop.stopped
    with pytest.raises(InvalidCheckpointState, match="write stopped"):
        write(tmp_path, stop)
    assert leftovers(tmp_path) == []


def test_stop_while_records_stream_publishes_nothing(tmp_path: pathlib.Path) -> None:
    stop = WriteStop()

    def stream() -> Iterator[Record]:
        for i, r in enumerate(recs()):
            if i == 2:
                stop.stop()
            yield r

    with pytest.raises(InvalidCheckpointState, match="write stopped"):
        write_participant(
            tmp_path, kind=KIND, instance=INST, checkpoint_id="c1", records=stream(), stop=stop
        )
    assert leftovers(tmp_path) == []


def test_stop_after_encoding_but_before_publication(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stop = WriteStop()
    real_fsync = os.fsync

    def fsync_then_stop(fd: int) -> None:
        real_fsync(fd)
        stop.stop()  # the records file is durable; publication has not begun

    monkeypatch.setattr(os, "fsync", fsync_then_stop)
    with pytest.raises(InvalidCheckpointState, match="write stopped"):
        write(tmp_path, stop)
    assert "manifest.json" not in leftovers(tmp_path)
    assert leftovers(tmp_path) == []


def test_stop_waits_for_a_publication_under_way(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stop = WriteStop()
    in_link, release = threading.Event(), threading.Event()
    real_link = os.link

    def slow_link(src: str, dst: str) -> None:
        in_link.set()
        assert release.wait(10)
        real_link(src, dst)

    monkeypatch.setattr(os, "link", slow_link)
    result: list[object] = []
    writer = threading.Thread(target=lambda: result.append(write(tmp_path, stop)))
    writer.start()
    assert in_link.wait(10)
    stopper = threading.Thread(target=stop.stop)
    stopper.start()
    stopper.join(0.2)
    assert stopper.is_alive()  # blocked behind the publication
    release.set()
    stopper.join(10)
    writer.join(10)
    assert result
    assert (participant_dir(tmp_path, KIND, INST) / "manifest.json").exists()
    # ...and once stop() has returned, a write never publishes.
    with pytest.raises(InvalidCheckpointState, match="write stopped"):
        write(tmp_path / "later", stop)


def test_an_fsync_error_aborts_and_is_not_retried(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def failing_fsync(fd: int) -> None:
        calls.append(fd)
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(InvalidCheckpointState, match=r"fsync .* failed"):
        write(tmp_path)
    assert len(calls) == 1  # no second fsync of a file whose pages may be gone
    monkeypatch.undo()
    assert leftovers(tmp_path) == []  # the temp file is gone; a new write starts afresh
    m = write(tmp_path)
    assert read_participant(tmp_path, kind=KIND, instance=INST, checkpoint_id="c1")[0] == m


class Crash(BaseException):
    """A process death at this point (BaseException: nothing may swallow it)."""


STEPS = ("write", "fsync", "replace", "link", "unlink", "mkdir")


def patch_steps(monkeypatch: pytest.MonkeyPatch, crash_at: int | None) -> list[str]:
    seen: list[str] = []
    lock = threading.Lock()

    def wrap(name: str, real):  # type: ignore[no-untyped-def]
        def step(*args, **kwargs):  # type: ignore[no-untyped-def]
            with lock:
                seen.append(name)
                if crash_at is not None and len(seen) - 1 == crash_at:
                    raise Crash(f"crash at step {crash_at} ({name})")
            return real(*args, **kwargs)

        return step

    for name in STEPS:
        monkeypatch.setattr(os, name, wrap(name, getattr(os, name)))
    return seen


def commit(d: pathlib.Path, cid: str, tag: str) -> None:
    manifests = [
        write_participant(d, kind=k, instance="i0", checkpoint_id=cid, records=recs(tag + k))
        for k in ("agent", "environment")
    ]
    write_gym_manifest(d, checkpoint_id=cid, manifests=manifests)


def test_a_crash_between_any_two_steps_leaves_old_or_refusable_state(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as m:
        steps = patch_steps(m, None)
        commit(tmp_path / "probe", "c2", "new")
    # Every name is published by a create-only hard link (never a replace).
    assert {"write", "fsync", "link"} <= set(steps)
    assert "replace" not in steps
    completed: list[int] = []
    for k in range(len(steps)):
        root = tmp_path / f"k{k}"
        commit(root / "ckpt-1", "c1", "old")
        with monkeypatch.context() as m:
            patch_steps(m, k)
            with pytest.raises(Crash):
                commit(root / "ckpt-2", "c2", "new")
        # The previous checkpoint is untouched and complete.
        assert verify_checkpoint(root / "ckpt-1").ok
        # The interrupted one is either complete (the crash came after the Gym
        # manifest's link) or refused cleanly as incomplete ...
        if gym_manifest_path(root / "ckpt-2").exists():
            assert verify_checkpoint(root / "ckpt-2").ok
            completed.append(k)
        else:
            with pytest.raises(InvalidCheckpointState, match="missing Gym manifest"):
                read_gym_manifest(root / "ckpt-2")
            assert not verify_checkpoint(root / "ckpt-2").ok
        # ... every participant either reads back in full or refuses with a typed error ...
        for kind in ("agent", "environment"):
            pd = participant_dir(root / "ckpt-2", kind, "i0")
            if (pd / "manifest.json").exists():
                _, got = read_participant(
                    root / "ckpt-2", kind=kind, instance="i0", checkpoint_id="c2"
                )
                assert got == recs("new" + kind)
            else:
                with pytest.raises(InvalidCheckpointState, match="missing manifest"):
                    read_participant(root / "ckpt-2", kind=kind, instance="i0", checkpoint_id="c2")
        # ... and committing it again from scratch succeeds.
        commit(root / "ckpt-2", "c2", "new")
        assert verify_checkpoint(root / "ckpt-2").ok
    # Only the last few steps (after the Gym manifest's link) may leave it complete.
    last_link = len(steps) - 1 - steps[::-1].index("link")
    assert completed == list(range(last_link + 1, len(steps)))


def test_every_published_name_is_fsynced_into_its_folder_before_the_commit_returns(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a power loss needs: each file is fsynced before its name appears,
    and a directory fsync after the last link covers every name published.
    The records file's name rides on the manifest's fsync (one folder, one
    fsync): three fsyncs per participant commit, not four."""
    participant_dir(tmp_path, KIND, INST).mkdir(parents=True)  # as pre-created
    events: list[tuple[str, str]] = []
    real_fsync, real_link = os.fsync, os.link

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def link(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
        events.append(("link", f"{src} -> {dst}"))
        real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    write(tmp_path)
    monkeypatch.undo()
    folder = str(participant_dir(tmp_path, KIND, INST))
    links = [i for i, (op, _) in enumerate(events) if op == "link"]
    assert len(links) == 2  # the records file, then the manifest
    for i in links:
        src = events[i][1].split(" -> ")[0]
        assert ("fsync", src) in events[:i], f"{src} linked before it was fsynced"
    dir_syncs = [i for i, e in enumerate(events) if e == ("fsync", folder)]
    assert dir_syncs, "no fsync of the participant's folder"
    assert dir_syncs[-1] > links[-1], "a name was published after the last folder fsync"
    assert sum(op == "fsync" for op, _ in events) == 3
