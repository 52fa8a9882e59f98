"""Which processes accept on a port, read from a /proc laid out on disk."""

from __future__ import annotations

import os
from pathlib import Path

from ray_ckpt.control.listeners import accepting_processes, listening_inodes

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"


def _row(local: str, state: str, inode: int) -> str:
    queues = "00000000:00000000 00:00000000 00000000"
    return f"   0: {local} 00000000:0000 {state} {queues}  1000        0 {inode} 1 0\n"


def _proc(tmp_path: Path) -> Path:
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    # Port 8000 = 0x1F40: a v4 listener (inode 11), a v6 one (12), an
    # established connection on it (13, not a listener); port 9000's listener (14).
    (proc / "net" / "tcp").write_text(
        HEADER
        + _row("0100007F:1F40", "0A", 11)
        + _row("0100007F:1F40", "01", 13)
        + _row("0100007F:2328", "0A", 14)
    )
    (proc / "net" / "tcp6").write_text(
        HEADER + _row("00000000000000000000000000000000:1F40", "0A", 12)
    )
    return proc


def _process(proc: Path, pid: int, fds: dict[int, str], epolls: dict[int, list[str]]) -> None:
    (proc / str(pid) / "fd").mkdir(parents=True)
    (proc / str(pid) / "fdinfo").mkdir()
    for fd, target in fds.items():
        os.symlink(target, proc / str(pid) / "fd" / str(fd))
    for fd, watched in epolls.items():
        os.symlink("anon_inode:[eventpoll]", proc / str(pid) / "fd" / str(fd))
        lines = "pos:\t0\nflags:\t02\n" + "".join(f"{w}\n" for w in watched)
        (proc / str(pid) / "fdinfo" / str(fd)).write_text(lines)


def test_the_listeners_of_a_port_v4_and_v6_and_nothing_else(tmp_path: Path) -> None:
    proc = _proc(tmp_path)
    assert listening_inodes(8000, proc) == {11, 12}
    assert listening_inodes(9000, proc) == {14}
    assert listening_inodes(7000, proc) == set()


def test_only_processes_whose_epoll_watches_the_listener_accept(tmp_path: Path) -> None:
    proc = _proc(tmp_path)
    # A worker: its epoll watches the listener (the kernel prints its inode, hex).
    _process(
        proc,
        101,
        {3: "socket:[11]"},
        {4: ["tfd:        3 events:       19 data: 3 pos:0 ino:b sdev:9"]},
    )
    # The supervisor: holds the socket, its epoll watches something else.
    _process(
        proc,
        100,
        {3: "socket:[11]", 5: "pipe:[77]"},
        {4: ["tfd:        5 events: 19 data: 5 pos:0 ino:4d sdev:9"]},
    )
    # A worker on an old kernel: no inode printed, the fd number decides.
    _process(
        proc,
        102,
        {7: "socket:[12]"},
        {4: ["tfd:        7 events:       19 data:                7"]},
    )
    # A process on the other port; one with no epoll at all.
    _process(proc, 103, {3: "socket:[14]"}, {4: ["tfd: 3 events: 19 data: 3 pos:0 ino:e sdev:9"]})
    _process(proc, 104, {3: "socket:[11]"}, {})
    (proc / "self").mkdir()  # not a pid: skipped
    assert accepting_processes(8000, proc) == [101, 102]
    assert accepting_processes(9000, proc) == [103]
    assert accepting_processes(7000, proc) is None  # no listener: cannot tell


def test_without_proc_it_cannot_tell(tmp_path: Path) -> None:
    assert accepting_processes(8000, tmp_path / "absent") is None
