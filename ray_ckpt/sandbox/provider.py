"""The sandbox provider contract: what a participant may ask of a tool sandbox.

An agentic episode on a coding or terminal task keeps most of its state in
a sandbox: the files the agent wrote, the repository it patched, the build it
ran.  A sandbox is state of the participant that owns it (an environment or
resources server), so it is captured with the episode's records at the
checkpoint's boundary and restored with them, all or nothing.

The contract, in the order an episode meets it:

- `create` a sandbox for an episode (generation 0), `run` commands in it;
- `capture` it at the episode's boundary, under the pause: the snapshot
  manifest (paths, modes, links, digests, the working directory and the
  environment) and the content-addressed files it names
  (`Captured.attachments`, BLAKE3 hex digest -> a local file holding exactly
  those bytes, immutable until the sandbox is freed).  The records carry the
  manifest in the episode's state and the files as the record's
  attachments, written once per digest beside the records;
- `restore` snapshots as **new** sandboxes (a new handle, the next
  generation), every one or none: a failure leaves nothing installed;
- `fence` an old generation (its commands are refused, `SandboxFenced`) and
  `free` it (its processes stopped, its files removed) when its attempt is
  retired.

A provider declares what its snapshot carries (`SandboxCapability`), and a
checkpoint never claims more: with `FILESYSTEM`, an episode whose sandbox has
a live process at its boundary is reported as a restart, never exported as
continuable (a copy of files is not a copy of a running process); with
`UNSUPPORTED`, every sandboxed episode is restart-only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Literal, Protocol, runtime_checkable

import msgspec


class SandboxCapability(StrEnum):
    """What a provider's snapshot carries."""

    # Files, modes, symlinks, the working directory and the environment; no
    # running process.  A live process at the boundary makes a restart.
    FILESYSTEM = "filesystem"
    # Running processes too (a hosted sandbox that snapshots memory).
    LIVE = "live"
    # Nothing is copied: the snapshot names the sandbox, and a restore
    # reattaches to it if it still exists (else the restore fails, typed).
    RECONNECT_ONLY = "reconnect-only"
    # No snapshot at all: every episode with a sandbox is restart-only.
    UNSUPPORTED = "unsupported"

    def continues(self, *, live_process: bool) -> bool:
        """May an episode whose sandbox is in this state be exported as continuable?"""
        if self is SandboxCapability.UNSUPPORTED:
            return False
        if self is SandboxCapability.FILESYSTEM:
            return not live_process
        return True


class SandboxHandle(msgspec.Struct, frozen=True, kw_only=True):
    """One generation of one sandbox.  A restore makes a new handle (the next
    generation); the old one is fenced and, when its attempt is retired, freed."""

    sandbox_id: str
    generation: int = 0


EntryKind = Literal["file", "dir", "symlink"]


class SnapshotEntry(msgspec.Struct, frozen=True, array_like=True):
    """One path of a snapshot, relative to the sandbox's root (POSIX, no `..`).

    A file names its content by `digest` (BLAKE3 hex) and `size`; a symlink
    its `target` (relative, inside the sandbox); a directory neither."""

    path: str
    kind: EntryKind
    mode: int  # the permission bits (stat.S_IMODE)
    size: int = 0
    digest: str | None = None
    target: str | None = None


class SandboxSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """What a restore rebuilds a sandbox from: JSON-plain once `to_builtins`'d,
    so it travels in the episode's record state."""

    provider: str
    capability: SandboxCapability
    sandbox_id: str
    generation: int
    cwd: str = "."  # relative to the sandbox's root
    env: dict[str, str] = {}
    entries: list[SnapshotEntry] = []

    def digests(self) -> set[str]:
        return {e.digest for e in self.entries if e.digest is not None}

    def bytes(self) -> int:
        """The bytes of its files, each distinct content counted once."""
        return sum({e.digest: e.size for e in self.entries if e.digest is not None}.values())


class Captured(msgspec.Struct, frozen=True, kw_only=True):
    """A capture at the boundary.  `live` says whether a process of the
    sandbox was still running then; `copied_bytes` what this capture copied
    (only files changed since the previous capture are)."""

    snapshot: SandboxSnapshot
    attachments: dict[str, str]  # digest -> local path holding exactly those bytes
    live: bool
    copied_bytes: int = 0


class CommandResult(msgspec.Struct, frozen=True, kw_only=True):
    """A finished (or timed-out) command.  A background command returns at
    once with `pid` set and `exit_code` None."""

    exit_code: int | None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    pid: int | None = None


@runtime_checkable
class SandboxProvider(Protocol):
    """What a participant asks of a sandbox provider (see the module docstring)."""

    name: str
    capability: SandboxCapability

    async def create(
        self, owner: str, *, cwd: str = ".", env: Mapping[str, str] | None = None
    ) -> SandboxHandle:
        """A new, empty sandbox for `owner` (an episode's capture key)."""
        ...

    async def write_file(
        self, handle: SandboxHandle, path: str, data: bytes, *, mode: int = 0o644
    ) -> None:
        """Create or replace a file (parents made); a bad path or size is refused."""
        ...

    async def read_file(self, handle: SandboxHandle, path: str) -> bytes: ...

    async def run(
        self,
        handle: SandboxHandle,
        argv: Sequence[str],
        *,
        timeout_s: float,
        background: bool = False,
    ) -> CommandResult:
        """Run `argv` in the sandbox's working directory, in its own process
        group; past `timeout_s` the group is killed and `timed_out` set."""
        ...

    def alive(self, handle: SandboxHandle) -> bool:
        """Is any process of this sandbox still running?"""
        ...

    async def capture(self, handle: SandboxHandle) -> Captured:
        """The snapshot at the boundary (`SandboxUnsupported` if the provider
        cannot), copying only what changed since the previous capture."""
        ...

    async def restore(
        self, items: Sequence[tuple[SandboxSnapshot, Mapping[str, str]]]
    ) -> list[SandboxHandle]:
        """Each snapshot as a new sandbox of the next generation, from its
        files (digest -> local path; each verified against its digest).  All
        or nothing: on any failure every sandbox made here is removed and the
        error raised (`InvalidCheckpointState` for a file that does not match)."""
        ...

    async def fence(self, handle: SandboxHandle) -> None:
        """Refuse every later call through this handle (`SandboxFenced`)."""
        ...

    async def free(self, handle: SandboxHandle) -> None:
        """Stop the sandbox's processes and remove its files; fences it too.
        Idempotent."""
        ...
