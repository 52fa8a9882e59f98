"""The local sandbox provider: a directory per sandbox, snapshots content-addressed.

`DirectorySandbox` keeps its sandboxes under a root the server gives it and
owns (one provider per root: it holds `<root>/lock`, and on taking the root
removes what a dead process left there, since a restarted server restores
from its checkpoint, never from those):

    <root>/trees/<sandbox_id>.g<generation>/   a sandbox's files
    <root>/cas/<digest>                        the captures' copies (`content`)
    <root>/stamp                               the file system's clock (below)

Commands run as subprocesses of the server, each leading a process group
of its own (`groups`), with the sandbox's environment, in its working
directory; past their timeout the whole group is killed.  A command's
output is read to its end, as `subprocess.run` does: a child left running
with the command's stdout open keeps the command running (redirect its
output, or run it with `background=True`).

A capture walks the tree without following symlinks and refuses, before
copying anything and keeping its previous index, a device, socket or FIFO,
a symlink that is absolute or resolves outside the tree, and a file over
`max_file_bytes`.  A regular file whose size, mtime, inode and ctime equal
those of the previous capture keeps its digest unread; any other is copied
into the content store while hashed.  So a capture's pause grows with what
changed, not with the tree.

Trusting an unchanged stat needs one guard (git's "racily clean" index
entries): timestamps advance in ticks of a few milliseconds, so a file
rewritten at the same size within the tick of its last change keeps the
same stat.  Each capture first touches `<root>/stamp` and reads its mtime,
the file system's own clock (the injected `Clock` cannot stand in for it);
a file whose ctime is not before that stamp is copied again at the next
capture instead of trusted.  Files copied while a process of the sandbox
ran are not trusted either (a writer may have been mid-write).

A restore builds every snapshot's tree beside the live ones and renames
them into place only when all were built and verified, so a failure
installs nothing.  It primes the new generation's index with the files it
wrote (their digests are known) but does not copy them into the content
store, which keeps a restore near the cost of a plain copy: the first
capture after a restore copies each file whose content the store does not
hold.

A freed sandbox's stored contents outlive it until the next capture (or
`close`): an asynchronous commit writes a capture's attachments after the
resume, while episodes run on and may finish, so freeing a sandbox must not
delete a file that write has still to read.  The engine starts the next
checkpoint's capture only once the previous write has ended (a write in
flight keeps prepare from being ready), so a sweep at the start of a capture
deletes nothing any write still reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import secrets
import shutil
import stat
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ray_ckpt.errors import (
    InvalidCheckpointState,
    NotFound,
    SandboxFenced,
    SandboxFileTooLarge,
    SandboxPathEscape,
    SandboxRefused,
    SandboxSpecialFile,
)
from ray_ckpt.sandbox import groups
from ray_ckpt.sandbox.content import (
    ContentStore,
    copy_hashing,
    new_buffer,
    open_regular,
)
from ray_ckpt.sandbox.paths import check_name, inside, relative, resolve
from ray_ckpt.sandbox.provider import (
    Captured,
    CommandResult,
    SandboxCapability,
    SandboxHandle,
    SandboxSnapshot,
    SnapshotEntry,
)

MAX_FILE_BYTES = 256 << 20
MAX_OUTPUT_BYTES = 1 << 20  # per stream of a command
# A sandbox made without an environment gets only a search path: commands
# see what the episode set, and a restore brings back exactly that.
DEFAULT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
# How long a killed group may take to go (a process in uninterruptible
# sleep dies when its I/O ends); past it, its files are removed anyway.
KILL_WAIT_S = 5.0

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class _Seen(NamedTuple):
    """A file as the last capture (or the restore) saw it."""

    size: int
    mtime_ns: int
    ino: int
    ctime_ns: int
    digest: str
    trusted: bool  # may the next capture reuse `digest` on an equal stat?

    def same(self, st: os.stat_result) -> bool:
        return (self.size, self.mtime_ns, self.ino, self.ctime_ns) == (
            st.st_size,
            st.st_mtime_ns,
            st.st_ino,
            st.st_ctime_ns,
        )


def _seen(st: os.stat_result, digest: str, *, stamp: int, trusted: bool = True) -> _Seen:
    racy = st.st_ctime_ns >= stamp or st.st_mtime_ns >= stamp
    return _Seen(
        st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns, digest, trusted and not racy
    )


@dataclass(eq=False)
class _Box:
    """One generation of one sandbox, as this provider runs it."""

    handle: SandboxHandle
    tree: str
    cwd: str
    env: dict[str, str]
    fenced: bool = False
    index: dict[str, _Seen] = field(default_factory=dict)
    held: set[str] = field(default_factory=set)  # digests its captures handed out
    groups: set[int] = field(default_factory=set)  # process groups it started
    # asyncio's objects of its running commands: a dropped one would kill its process.
    procs: list[asyncio.subprocess.Process] = field(default_factory=list)
    deadlines: dict[int, asyncio.TimerHandle] = field(default_factory=dict)
    freeing: asyncio.Future[None] | None = None


class _Found(NamedTuple):
    path: str
    st: os.stat_result
    target: str | None  # a symlink's


class _Capture(NamedTuple):
    entries: list[SnapshotEntry]
    seen: dict[str, _Seen]
    copied_bytes: int


class _Plan(NamedTuple):
    snapshot: SandboxSnapshot
    attachments: Mapping[str, str]
    handle: SandboxHandle
    tree: str


class DirectorySandbox:
    """Sandboxes as directories under `root` (see the module docstring).

    `max_file_bytes` bounds a file written, read, captured or restored;
    `max_output_bytes` what a command's stdout and stderr each keep.  Call
    `close` when done: it frees every sandbox and releases the root."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_file_bytes: int = MAX_FILE_BYTES,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
        name: str = "directory",
    ) -> None:
        if max_file_bytes < 0 or max_output_bytes < 0:
            raise ValueError("the bounds cannot be negative")
        self.name = name
        self.capability = SandboxCapability.FILESYSTEM
        self.max_file_bytes = max_file_bytes
        self.max_output_bytes = max_output_bytes
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self._lock: int | None = _take(os.path.join(self.root, "lock"))
        self._trees = os.path.join(self.root, "trees")
        _rmtree(self._trees)
        os.makedirs(self._trees)
        self._cas = ContentStore(os.path.join(self.root, "cas"))
        self._cas.adopt()
        self._stamp_path = os.path.join(self.root, "stamp")
        with open(self._stamp_path, "ab"):
            pass
        self._boxes: dict[SandboxHandle, _Box] = {}
        self._sweep_due = False  # a free released contents the next capture deletes
        self._freed: set[SandboxHandle] = set()
        self._generations: dict[str, int] = {}  # the highest made here, per sandbox
        # Captures under way: the store is swept only when there are none,
        # so no capture hands out a digest whose file a sweep deletes.
        self._capturing = 0
        self._no_capture = asyncio.Event()
        self._no_capture.set()

    # -- the contract ------------------------------------------------------

    async def create(
        self, owner: str, *, cwd: str = ".", env: Mapping[str, str] | None = None
    ) -> SandboxHandle:
        """A new, empty sandbox (generation 0), its id `<owner>-<8 hex>`.
        `cwd` is made in it; `env` is exactly its commands' environment
        (`DEFAULT_ENV` when None)."""
        check_name(owner, "owner")
        rel_cwd = relative(cwd) or "."
        environment = dict(DEFAULT_ENV if env is None else env)
        while True:
            sandbox_id = check_name(f"{owner}-{secrets.token_hex(4)}", "sandbox id")
            if sandbox_id not in self._generations:
                break
        handle = SandboxHandle(sandbox_id=sandbox_id, generation=0)
        tree = self._tree(handle)
        os.mkdir(tree)
        os.makedirs(os.path.join(tree, rel_cwd), exist_ok=True)
        self._generations[sandbox_id] = 0
        self._boxes[handle] = _Box(handle, tree, rel_cwd, environment)
        return handle

    async def write_file(
        self, handle: SandboxHandle, path: str, data: bytes, *, mode: int = 0o644
    ) -> None:
        """Create or replace the file at `path` (parents made), atomically:
        a process reading it sees the old or the new bytes.  Refused before
        anything changes: a path escaping the sandbox, a parent that is not
        a directory, data over the bound, a mode beyond the permission bits."""
        box = self._open(handle)
        if not 0 <= mode <= 0o7777:
            raise SandboxRefused(f"mode {mode:#o} is not permission bits")
        if len(data) > self.max_file_bytes:
            raise SandboxFileTooLarge(
                f"{path}: {len(data)} bytes, over the sandbox's bound of {self.max_file_bytes}"
            )
        await asyncio.to_thread(_write, box.tree, path, data, mode)

    async def read_file(self, handle: SandboxHandle, path: str) -> bytes:
        """The bytes of the regular file at `path` (`NotFound` if none)."""
        box = self._open(handle)
        return await asyncio.to_thread(_read, box.tree, path, self.max_file_bytes)

    async def run(
        self,
        handle: SandboxHandle,
        argv: Sequence[str],
        *,
        timeout_s: float,
        background: bool = False,
    ) -> CommandResult:
        """Run `argv` in the sandbox's working directory and environment, in
        a process group of its own.  Past `timeout_s` the group is killed
        (`timed_out`, exit code -9); a cancelled call kills it too.  With
        `background` it returns at once with the pid, its output discarded,
        and the group is killed if still running at `timeout_s`.  A program
        or working directory that is missing gives exit code 127 (126: not
        executable), as a shell would."""
        box = self._open(handle)
        if not argv:
            raise SandboxRefused("an empty command")
        if not timeout_s > 0:
            raise SandboxRefused(f"timeout {timeout_s} s: it must be positive")
        cwd = resolve(box.tree, box.cwd)
        out = subprocess.DEVNULL if background else subprocess.PIPE
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=cwd,
                env=box.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        except (FileNotFoundError, NotADirectoryError) as exc:
            return CommandResult(exit_code=127, stderr=f"{exc}\n")
        except PermissionError as exc:
            return CommandResult(exit_code=126, stderr=f"{exc}\n")
        pgid = proc.pid  # a session leader leads its group
        box.groups.add(pgid)
        box.procs.append(proc)
        if background:
            loop = asyncio.get_running_loop()
            box.deadlines[pgid] = loop.call_later(timeout_s, self._expire, box, pgid)
            return CommandResult(exit_code=None, pid=pgid)
        return await self._finish(box, proc, timeout_s)

    def alive(self, handle: SandboxHandle) -> bool:
        """Is a process of this sandbox running?  Any process of any group
        its commands started, the commands themselves gone or not.  Answers
        for a fenced generation too (its processes run until it is freed);
        a freed or unknown one has none."""
        box = self._boxes.get(handle)
        return box is not None and self._alive(box)

    async def capture(self, handle: SandboxHandle) -> Captured:
        """The sandbox's snapshot, copying into the content store only the
        files changed since its previous capture (see the module docstring);
        `live` if a process of it ran before or after the walk."""
        box = self._open(handle)
        if self._sweep_due:
            # No write of an earlier capture runs now (module docstring).
            await self._quiet()
            self._sweep_due = False
            self._cas.sweep()  # synchronous: no capture can start meanwhile
            box = self._open(handle)  # freed or fenced while we waited?
        live = self._alive(box)
        created: list[str] = []
        known = self._cas.known()  # here, on the loop: other captures' results change it
        self._capturing += 1
        self._no_capture.clear()
        job = asyncio.ensure_future(asyncio.to_thread(self._capture, box, known, live, created))
        job.add_done_callback(lambda job: self._book(box, job, created))
        # Shielded: a cancelled capture's thread runs on, and `_book` still
        # accounts for what it stored once it ends.
        found = await asyncio.shield(job)
        digests = {e.digest for e in found.entries if e.digest is not None}
        live = live or self._alive(box)
        snapshot = SandboxSnapshot(
            provider=self.name,
            capability=self.capability,
            sandbox_id=handle.sandbox_id,
            generation=handle.generation,
            cwd=box.cwd,
            env=dict(box.env),
            entries=found.entries,
        )
        return Captured(
            snapshot=snapshot,
            attachments={d: self._cas.path(d) for d in sorted(digests)},
            live=live,
            copied_bytes=found.copied_bytes,
        )

    async def restore(
        self, items: Sequence[tuple[SandboxSnapshot, Mapping[str, str]]]
    ) -> list[SandboxHandle]:
        """Each snapshot as a new sandbox, all or nothing.

        Its generation is the next one: one past the snapshot's, or past the
        highest this provider has made of that sandbox.  Every file is copied
        from its attachment while hashed; a file whose bytes do not match its
        digest and size, or a missing attachment, is `InvalidCheckpointState`;
        an escaping path or symlink `SandboxPathEscape`, a file over the bound
        `SandboxFileTooLarge`.  On any failure every tree this call made is
        removed and nothing is installed.  On success, any older generation
        of the same sandbox still registered here is fenced."""
        plans: list[_Plan] = []
        ids: set[str] = set()
        for snapshot, attachments in items:
            self._check_snapshot(snapshot, attachments)
            if snapshot.sandbox_id in ids:
                raise InvalidCheckpointState(
                    f"sandbox {snapshot.sandbox_id} is restored twice in one call"
                )
            ids.add(snapshot.sandbox_id)
            # Reserved now: a concurrent restore of it takes the next one.
            gen = max(snapshot.generation, self._generations.get(snapshot.sandbox_id, -1)) + 1
            self._generations[snapshot.sandbox_id] = gen
            handle = SandboxHandle(sandbox_id=snapshot.sandbox_id, generation=gen)
            plans.append(_Plan(snapshot, attachments, handle, self._tree(handle)))
        if not plans:
            return []
        job = asyncio.ensure_future(asyncio.to_thread(self._build_all, plans))
        try:
            indexes = await asyncio.shield(job)
        except asyncio.CancelledError:
            # Nothing is installed; the trees the thread builds (or built,
            # if it ended as this was cancelled) are removed once it ends.
            job.add_done_callback(lambda job: self._discard(job, plans))
            raise
        for plan, index in zip(plans, indexes, strict=True):
            snap = plan.snapshot
            for old in self._boxes.values():
                if old.handle.sandbox_id == snap.sandbox_id:
                    old.fenced = True
            self._boxes[plan.handle] = _Box(
                plan.handle, plan.tree, relative(snap.cwd) or ".", dict(snap.env), index=index
            )
        return [p.handle for p in plans]

    async def fence(self, handle: SandboxHandle) -> None:
        """Refuse every later call through `handle` (`SandboxFenced`); its
        processes run on until it is freed.  Idempotent."""
        box = self._boxes.get(handle)
        if box is not None:
            box.fenced = True

    async def free(self, handle: SandboxHandle) -> None:
        """Fence it, kill its process groups, remove its tree, and delete the
        stored contents no other sandbox holds, all before returning.
        Idempotent, also when called again before the first call returns
        (each waits for the one freeing); a cancelled call does not stop the
        freeing.  An unknown handle is a no-op."""
        box = self._boxes.get(handle)
        if box is None:
            return
        if box.freeing is None:
            box.freeing = asyncio.ensure_future(self._free(box))
        await asyncio.shield(box.freeing)

    async def _free(self, box: _Box) -> None:
        try:
            box.fenced = True
            for timer in box.deadlines.values():
                timer.cancel()
            for pgid in box.groups:
                groups.kill(pgid)
            await self._until_dead(box)
            await self._quiet()  # its own capture may still be walking the tree
            await asyncio.to_thread(_rmtree, box.tree)
            del self._boxes[box.handle]
            self._freed.add(box.handle)
            self._cas.release(box.held)
            box.held.clear()
            # Not swept here: a commit's write may still read these contents
            # (see the module docstring); the next capture sweeps them.
            self._sweep_due = True
        except BaseException:
            box.freeing = None  # a later free tries again
            raise

    async def close(self) -> None:
        """Free every sandbox and release the root.  Idempotent."""
        for handle in list(self._boxes):
            await self.free(handle)
        await self._quiet()
        self._cas.sweep()
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor drops the lock
            self._lock = None

    # -- beyond the contract -----------------------------------------------

    def directory(self, handle: SandboxHandle) -> Path:
        """Where the sandbox's files are, for tools that work on them in
        place (what they leave there is what the next capture sees)."""
        return Path(self._open(handle).tree)

    # -- internals ---------------------------------------------------------

    def _tree(self, handle: SandboxHandle) -> str:
        return os.path.join(self._trees, f"{handle.sandbox_id}.g{handle.generation}")

    def _open(self, handle: SandboxHandle) -> _Box:
        """The live box behind `handle`; `SandboxFenced` for any other."""
        box = self._boxes.get(handle)
        if box is not None and not box.fenced:
            return box
        if box is not None:
            why = "was fenced (a restore replaced it, or it is being retired)"
        elif handle in self._freed:
            why = "was freed"
        else:
            why = "is not one of this provider's"
        raise SandboxFenced(f"sandbox {handle.sandbox_id} generation {handle.generation} {why}")

    def _book(self, box: _Box, job: asyncio.Future[_Capture], created: list[str]) -> None:
        """A capture's thread ended: its result becomes the box's index and
        holdings, in the same step as the count of captures under way drops,
        so no sweep runs between them and deletes a digest it reused."""
        try:
            if not job.cancelled() and job.exception() is None:
                found = job.result()
                digests = {e.digest for e in found.entries if e.digest is not None}
                self._cas.hold(digests - box.held)
                box.held |= digests
                box.index = found.seen
        finally:
            self._cas.stored(created)  # a failed capture's copies: swept later
            self._capturing -= 1
            if not self._capturing:
                self._no_capture.set()

    def _discard(self, job: asyncio.Future[list[dict[str, _Seen]]], plans: Sequence[_Plan]) -> None:
        """The trees of a cancelled restore, once its thread ended."""
        if job.cancelled() or job.exception() is not None:
            return  # it removed them itself
        loop = asyncio.get_running_loop()
        for plan in plans:
            loop.run_in_executor(None, _rmtree, plan.tree)

    async def _quiet(self) -> None:
        """Until no capture is under way (one may start as soon as the last
        ends, before this resumes: hence the loop)."""
        while self._capturing:
            await self._no_capture.wait()

    def _alive(self, box: _Box) -> bool:
        box.procs = [p for p in box.procs if p.returncode is None]
        for pgid in list(box.groups):
            if groups.alive(pgid):
                return True
            box.groups.discard(pgid)
            timer = box.deadlines.pop(pgid, None)
            if timer is not None:
                timer.cancel()
        return False

    def _expire(self, box: _Box, pgid: int) -> None:
        """A background command's deadline."""
        box.deadlines.pop(pgid, None)
        if pgid in box.groups:
            groups.kill(pgid)

    async def _until_dead(self, box: _Box) -> None:
        # Polled: nothing signals the death of a process that is not our child.
        for _ in range(int(KILL_WAIT_S / 0.01)):
            if not self._alive(box):
                return
            await asyncio.sleep(0.01)

    async def _finish(
        self, box: _Box, proc: asyncio.subprocess.Process, timeout_s: float
    ) -> CommandResult:
        """Read a foreground command to its end (or its timeout)."""
        assert proc.stdout is not None
        assert proc.stderr is not None
        out, err = bytearray(), bytearray()
        tasks = {
            asyncio.create_task(groups.read_bounded(proc.stdout, out, self.max_output_bytes)),
            asyncio.create_task(groups.read_bounded(proc.stderr, err, self.max_output_bytes)),
            asyncio.create_task(proc.wait()),  # returns once its pipes are closed too
        }
        timed_out = False
        try:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            if pending:
                timed_out = True
                groups.kill(proc.pid)
                # The pipes close when the last process holding them dies; one
                # that left the group (setsid) may hold them on: stop waiting.
                _, pending = await asyncio.wait(pending, timeout=KILL_WAIT_S)
        except BaseException:
            groups.kill(proc.pid)  # cancelled: the command goes too
            raise
        finally:
            for task in tasks:
                task.cancel()
        return CommandResult(
            exit_code=proc.returncode,
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            timed_out=timed_out,
            pid=proc.pid,
        )

    def _stamp(self) -> int:
        """The file system's time now, at its own granularity (see the
        module docstring)."""
        os.utime(self._stamp_path)
        return os.stat(self._stamp_path).st_mtime_ns

    def _capture(
        self, box: _Box, known: frozenset[str], live: bool, created: list[str]
    ) -> _Capture:
        """The walk and the copies, on a thread: reads `box.index`, changes
        nothing of the box (the caller installs the result)."""
        stamp = self._stamp()
        found = _walk(box.tree, self.max_file_bytes)  # refusals here, before any copy
        present = set(known)
        buf = new_buffer()
        entries: list[SnapshotEntry] = []
        index: dict[str, _Seen] = {}
        copied = 0
        for f in found:
            mode = stat.S_IMODE(f.st.st_mode)
            if stat.S_ISDIR(f.st.st_mode):
                entries.append(SnapshotEntry(f.path, "dir", mode))
                continue
            if f.target is not None:
                entries.append(SnapshotEntry(f.path, "symlink", mode, target=f.target))
                continue
            prev = box.index.get(f.path)
            if prev is not None and prev.trusted and prev.same(f.st) and prev.digest in present:
                seen = prev
            else:
                try:
                    fd = open_regular(os.path.join(box.tree, f.path), what=f.path)
                except FileNotFoundError:
                    continue  # deleted since the walk: as if before it
                except PermissionError:
                    raise SandboxRefused(f"{f.path} cannot be read (its mode)") from None
                try:
                    digest, size, made = self._cas.put(
                        fd, buf, limit=self.max_file_bytes, what=f.path
                    )
                finally:
                    os.close(fd)
                if made:
                    created.append(digest)
                present.add(digest)
                copied += size
                st = f.st
                seen = _Seen(st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns, digest, False)
                if size == st.st_size:  # else it changed under the copy: never trusted
                    seen = _seen(st, digest, stamp=stamp, trusted=not live)
            index[f.path] = seen
            entries.append(SnapshotEntry(f.path, "file", mode, seen.size, seen.digest))
        return _Capture(entries, index, copied)

    def _check_snapshot(self, snap: SandboxSnapshot, attachments: Mapping[str, str]) -> None:
        """Everything about a snapshot that can be refused before a byte is
        written (the bytes themselves are checked as they are copied)."""
        sid = snap.sandbox_id
        if snap.provider != self.name or snap.capability != self.capability:
            raise InvalidCheckpointState(
                f"sandbox {sid}: a snapshot of provider {snap.provider!r} "
                f"({snap.capability}), not of {self.name!r} ({self.capability})"
            )
        check_name(sid, "sandbox id")
        if snap.generation < 0:
            raise InvalidCheckpointState(f"sandbox {sid}: generation {snap.generation}")
        relative(snap.cwd)
        dirs = {e.path for e in snap.entries if e.kind == "dir"}
        paths: set[str] = set()
        for e in snap.entries:
            if relative(e.path) != e.path or not e.path:
                raise InvalidCheckpointState(f"sandbox {sid}: path {e.path!r} is not normalized")
            if e.path in paths:
                raise InvalidCheckpointState(f"sandbox {sid}: path {e.path!r} is listed twice")
            paths.add(e.path)
            parent = e.path.rpartition("/")[0]
            if parent and parent not in dirs:
                raise InvalidCheckpointState(
                    f"sandbox {sid}: {e.path!r} is under {parent!r}, which is no directory of it"
                )
            if not 0 <= e.mode <= 0o7777:
                raise InvalidCheckpointState(f"sandbox {sid}: {e.path!r} has mode {e.mode:#o}")
            if e.kind == "file":
                if e.digest is None or not _HEX64.match(e.digest) or e.size < 0:
                    raise InvalidCheckpointState(f"sandbox {sid}: file {e.path!r} has no digest")
                if e.digest not in attachments:
                    raise InvalidCheckpointState(
                        f"sandbox {sid}: file {e.path!r}: no attachment holds {e.digest}"
                    )
                if e.size > self.max_file_bytes:
                    raise SandboxFileTooLarge(
                        f"sandbox {sid}: file {e.path!r} has {e.size} bytes, over the "
                        f"sandbox's bound of {self.max_file_bytes}"
                    )
            elif e.kind == "symlink":
                if not e.target or "\0" in e.target:
                    raise InvalidCheckpointState(f"sandbox {sid}: symlink {e.path!r} has no target")
                if e.target.startswith("/"):
                    raise SandboxPathEscape(
                        f"sandbox {sid}: symlink {e.path!r} points to an absolute path"
                    )
            elif e.kind != "dir":
                raise InvalidCheckpointState(f"sandbox {sid}: {e.path!r} is a {e.kind!r}")

    def _build_all(self, plans: Sequence[_Plan]) -> list[dict[str, _Seen]]:
        """Every plan's tree, on a thread: built under temporary names,
        verified, then renamed into place; on any failure all removed."""
        made: list[str] = []
        buf = new_buffer()
        try:
            temps = []
            for plan in plans:
                tmp = os.path.join(self._trees, f".restore-{uuid.uuid4().hex}")
                os.mkdir(tmp, 0o700)
                made.append(tmp)
                temps.append(tmp)
                _build(tmp, plan.snapshot, plan.attachments, buf)
            stamp = self._stamp()  # after the last write: see `_seen`
            pairs = zip(temps, plans, strict=True)
            indexes = [_prime(tmp, plan.snapshot, stamp) for tmp, plan in pairs]
            for i, plan in enumerate(plans):
                os.rename(temps[i], plan.tree)
                made[i] = plan.tree
        except BaseException:
            for path in made:
                _rmtree(path)
            raise
        return indexes


def _take(path: str) -> int:
    """The root's lock, held for the provider's life."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SandboxRefused(
            f"sandbox root {os.path.dirname(path)} is in use by another provider"
        ) from None
    return fd


def _walk(tree: str, max_bytes: int) -> list[_Found]:
    """Every path under `tree` (symlinks not followed), sorted; refused:
    special files, escaping symlinks, files over `max_bytes`."""
    real_tree = os.path.realpath(tree)
    found: list[_Found] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            listing = os.scandir(os.path.join(tree, rel))
        except PermissionError:
            raise SandboxRefused(f"directory {rel or '.'} cannot be listed (its mode)") from None
        with listing as it:
            for de in it:
                path = f"{rel}/{de.name}" if rel else de.name
                st = de.stat(follow_symlinks=False)
                target = None
                if stat.S_ISDIR(st.st_mode):
                    stack.append(path)
                elif stat.S_ISLNK(st.st_mode):
                    target = os.readlink(de.path)
                    if target.startswith("/"):
                        raise SandboxPathEscape(f"symlink {path} points to an absolute path")
                    if not inside(real_tree, de.path):
                        raise SandboxPathEscape(f"symlink {path} leads outside the sandbox")
                elif not stat.S_ISREG(st.st_mode):
                    raise SandboxSpecialFile(
                        f"{path} is a {_kind(st.st_mode)}: a snapshot carries only "
                        "regular files, directories and symlinks"
                    )
                elif st.st_size > max_bytes:
                    raise SandboxFileTooLarge(
                        f"{path} has {st.st_size} bytes, over the sandbox's bound of {max_bytes}"
                    )
                found.append(_Found(path, st, target))
    found.sort(key=lambda f: f.path)
    return found


def _kind(mode: int) -> str:
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def _build(tmp: str, snap: SandboxSnapshot, attachments: Mapping[str, str], buf: bytearray) -> None:
    """One snapshot's tree in the empty directory `tmp`."""
    sid = snap.sandbox_id
    entries = sorted(snap.entries, key=lambda e: e.path)  # a parent before its children
    for e in entries:
        full = os.path.join(tmp, e.path)
        if e.kind == "dir":
            os.mkdir(full, 0o700)  # its own mode once its children are in
        elif e.kind == "symlink":
            assert e.target is not None
            os.symlink(e.target, full)
        else:
            assert e.digest is not None
            _restore_file(full, e, attachments[e.digest], buf, sid)
    real = os.path.realpath(tmp)
    for e in entries:
        if e.kind == "symlink" and not inside(real, os.path.join(tmp, e.path)):
            raise SandboxPathEscape(f"sandbox {sid}: symlink {e.path!r} leads outside it")
    for e in reversed(entries):  # children first: a read-only directory is filled already
        if e.kind == "dir":
            os.chmod(os.path.join(tmp, e.path), e.mode)
    os.chmod(tmp, 0o755)


def _restore_file(full: str, e: SnapshotEntry, src_path: str, buf: bytearray, sid: str) -> None:
    what = f"sandbox {sid}: file {e.path!r}"
    try:
        src = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidCheckpointState(f"{what}: its attachment cannot be read ({exc})") from None
    try:
        dst = os.open(full, _CREATE, 0o600)
        try:
            digest, size = copy_hashing(src, dst, buf, limit=e.size, what=what)
            if (digest, size) != (e.digest, e.size):
                raise InvalidCheckpointState(f"{what}: its attachment holds other bytes")
            os.fchmod(dst, e.mode)
        except SandboxFileTooLarge:
            raise InvalidCheckpointState(f"{what}: its attachment holds more bytes") from None
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _prime(tree: str, snap: SandboxSnapshot, stamp: int) -> dict[str, _Seen]:
    """The index a restored tree starts with: the digests it was built from."""
    index: dict[str, _Seen] = {}
    for e in snap.entries:
        if e.kind == "file" and e.digest is not None:
            index[e.path] = _seen(os.lstat(os.path.join(tree, e.path)), e.digest, stamp=stamp)
    return index


def _write(tree: str, path: str, data: bytes, mode: int) -> None:
    target = resolve(tree, path)
    if target == os.path.realpath(tree):
        raise SandboxRefused(f"path {path!r} names the sandbox itself, not a file")
    if os.path.isdir(target):
        raise SandboxRefused(f"{path} is a directory")
    parent = os.path.dirname(target)
    probe = parent
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise SandboxRefused(f"{path}: a parent of it is not a directory")
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(target)}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, _CREATE, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, target)


def _read(tree: str, path: str, max_bytes: int) -> bytes:
    target = resolve(tree, path)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        raise NotFound(f"no file {path} in the sandbox") from None
    if stat.S_ISDIR(st.st_mode):
        raise SandboxRefused(f"{path} is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise SandboxSpecialFile(f"{path} is a {_kind(st.st_mode)}")
    if st.st_size > max_bytes:
        raise SandboxFileTooLarge(
            f"{path} has {st.st_size} bytes, over the sandbox's bound of {max_bytes}"
        )
    fd = open_regular(target, what=path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise SandboxFileTooLarge(f"{path} grew over the sandbox's bound of {max_bytes} bytes")
    return data


def _rmtree(path: str) -> None:
    """Remove a tree, even one whose directories the sandbox made read-only."""
    if not os.path.lexists(path):
        return
    try:
        shutil.rmtree(path)
        return
    except OSError:
        pass
    # Opened up top-down: os.walk lists a directory after its parent's turn.
    for d in [path]:
        if not os.path.islink(d):
            with contextlib.suppress(OSError):
                os.chmod(d, 0o700)
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            d = os.path.join(dirpath, name)
            if not os.path.islink(d):
                with contextlib.suppress(OSError):
                    os.chmod(d, 0o700)
    shutil.rmtree(path)
