"""Coordination: participant order, the Coordinator actor, the handle, the CLI."""

from coordination.handle import CoordinatorHandle, connect

__all__ = ["CoordinatorHandle", "connect"]
