"""Sandbox providers for tests of what uses sandboxes (participants, the engine).

`UnsupportedSandbox` serves sandboxes like `DirectorySandbox` (it wraps one:
real directories, real processes) but declares `UNSUPPORTED` and refuses
every capture and restore (`SandboxUnsupported`): a participant holding its
sandboxes must report their episodes restart-only and never ask.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from ray_ckpt.errors import SandboxUnsupported
from ray_ckpt.sandbox import (
    Captured,
    CommandResult,
    DirectorySandbox,
    SandboxCapability,
    SandboxHandle,
    SandboxSnapshot,
)


class UnsupportedSandbox:
    """A provider whose snapshots carry nothing (see the module docstring)."""

    capability = SandboxCapability.UNSUPPORTED

    def __init__(self, root: str | os.PathLike[str], *, name: str = "unsupported") -> None:
        self.name = name
        self.inner = DirectorySandbox(root, name=name)
        self.captures = 0  # asked anyway: a participant that should not have
        self.restores = 0

    async def create(
        self, owner: str, *, cwd: str = ".", env: Mapping[str, str] | None = None
    ) -> SandboxHandle:
        return await self.inner.create(owner, cwd=cwd, env=env)

    async def write_file(
        self, handle: SandboxHandle, path: str, data: bytes, *, mode: int = 0o644
    ) -> None:
        await self.inner.write_file(handle, path, data, mode=mode)

    async def read_file(self, handle: SandboxHandle, path: str) -> bytes:
        return await self.inner.read_file(handle, path)

    async def run(
        self,
        handle: SandboxHandle,
        argv: Sequence[str],
        *,
        timeout_s: float,
        background: bool = False,
    ) -> CommandResult:
        return await self.inner.run(handle, argv, timeout_s=timeout_s, background=background)

    def alive(self, handle: SandboxHandle) -> bool:
        return self.inner.alive(handle)

    async def capture(self, handle: SandboxHandle) -> Captured:
        self.captures += 1
        raise SandboxUnsupported(f"provider {self.name!r} cannot snapshot its sandboxes")

    async def restore(
        self, items: Sequence[tuple[SandboxSnapshot, Mapping[str, str]]]
    ) -> list[SandboxHandle]:
        self.restores += 1
        raise SandboxUnsupported(f"provider {self.name!r} cannot restore a sandbox")

    async def fence(self, handle: SandboxHandle) -> None:
        await self.inner.fence(handle)

    async def free(self, handle: SandboxHandle) -> None:
        await self.inner.free(handle)

    async def close(self) -> None:
        await self.inner.close()
