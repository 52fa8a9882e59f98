"""Which processes accept on a TCP port, read from Linux's /proc.

A server run by several unmanaged workers (uvicorn's ``--workers``) shares
one listening socket between them.  Probing it over fresh connections can
miss that: on a loaded machine the kernel wakes the same worker first so
often that two dozen probes may all land on one process.  The server itself
can tell for sure: a process *accepts* on the port if one of its epoll sets
watches a listening socket bound to it.  Holding the socket is not enough:
uvicorn's and gunicorn's supervisors hold it and never accept, and counting
them would refuse a server with one worker.

Only processes whose /proc this one may read are seen (the same user's);
`None` where /proc cannot tell (not Linux, a port without a TCP listener).
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


def accepting_processes(port: int, proc: Path = PROC) -> list[int] | None:
    """The pids whose event loops accept on `port`, this one included."""
    inodes = listening_inodes(port, proc)
    if not inodes:
        return None
    found = []
    for entry in os.scandir(proc):
        if entry.name.isdigit() and _accepts(Path(entry.path), inodes):
            found.append(int(entry.name))
    return sorted(found)


def listening_inodes(port: int, proc: Path = PROC) -> set[int]:
    """The inodes of the listening TCP sockets (IPv4 and IPv6) bound to `port`."""
    inodes: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            listening = len(fields) > 9 and fields[3] == _LISTEN
            if listening and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
    return inodes


def _accepts(pid_dir: Path, inodes: set[int]) -> bool:
    """Whether the process holds one of `inodes` and an epoll set watches it."""
    held: set[int] = set()  # its fd numbers for those sockets
    epolls: list[str] = []
    try:
        with os.scandir(pid_dir / "fd") as fds:
            for fd in fds:
                try:
                    link = os.readlink(fd.path)
                except OSError:
                    continue  # closed meanwhile
                if link == "anon_inode:[eventpoll]":
                    epolls.append(fd.name)
                elif link.startswith("socket:[") and int(link[8:-1]) in inodes:
                    held.add(int(fd.name))
    except OSError:
        return False  # another user's process, or gone
    return bool(held) and any(_watches(pid_dir / "fdinfo" / e, held, inodes) for e in epolls)


def _watches(fdinfo: Path, held: set[int], inodes: set[int]) -> bool:
    """Whether the epoll set described by `fdinfo` watches one of the sockets.

    Each watched file is a line ``tfd: <fd> events: ... ino:<hex> sdev:..``;
    the inode decides where the kernel prints it (since 3.8), else the fd.
    """
    try:
        text = fdinfo.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if not line.startswith("tfd:"):
            continue
        fields = line.split()
        ino = next((f[4:] for f in fields if f.startswith("ino:")), None)
        if ino is not None:
            if int(ino, 16) in inodes:
                return True
        elif int(fields[1]) in held:
            return True
    return False
