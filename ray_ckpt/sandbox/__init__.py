"""Tool sandboxes as participant state: the provider contract (`provider`)
and the local provider that snapshots a directory (`directory`)."""

from ray_ckpt.sandbox.directory import DirectorySandbox
from ray_ckpt.sandbox.provider import (
    Captured,
    CommandResult,
    SandboxCapability,
    SandboxHandle,
    SandboxProvider,
    SandboxSnapshot,
    SnapshotEntry,
)

__all__ = [
    "Captured",
    "CommandResult",
    "DirectorySandbox",
    "SandboxCapability",
    "SandboxHandle",
    "SandboxProvider",
    "SandboxSnapshot",
    "SnapshotEntry",
]
