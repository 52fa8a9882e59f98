"""Process groups: how a sandbox's commands are stopped and found alive.

Every command a sandbox runs leads a process group of its own (a new
session), so its children, and theirs, can be killed together and asked
after together, even after the command that started them has exited.  A
process that leaves the group (`setsid`) escapes both: confining it needs
a container, which a directory sandbox is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal


def kill(pgid: int) -> None:
    """SIGKILL the whole group (nothing if it is gone already)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def alive(pgid: int) -> bool:
    """Is a process of the group still running (not merely a zombie)?

    `killpg(pgid, 0)` answers for the common case, a group that is gone.
    A group whose processes have all exited but are not yet reaped still
    exists for it: an orphaned child is reaped by init (or by whichever
    subreaper adopted it), and in a container whose init reaps nothing it
    never is.  So a group that exists is confirmed in /proc: by its leader
    when that one still runs, else by any running member.  Without /proc
    the answer is yes: a wrong yes makes an episode a restart, a wrong no
    would make a live process look like files."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists; not ours to signal
    leader = _state(pgid)
    if leader is not None:
        state, group = leader
        if group == pgid and state not in "ZX":
            return True
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return True
    for pid in pids:
        member = _state(pid)
        if member is not None and member[1] == pgid and member[0] not in "ZX":
            return True
    return False


def _state(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of `pid` from /proc, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) < 3:
        return None
    return fields[0].decode(), int(fields[2])


async def read_bounded(stream: asyncio.StreamReader, into: bytearray, limit: int) -> None:
    """Read `stream` to its end, keeping its first `limit` bytes in `into`.

    The rest is read and dropped, so a chatty command never blocks on a
    full pipe and never grows the server's memory past the bound."""
    while chunk := await stream.read(65536):
        room = limit - len(into)
        if room > 0:
            into += chunk[:room]
