"""Coordination: participant order, the Coordinator actor, the handle, the CLI."""

from coordination.handle import CoordinatorHandle, aconnect, connect

__all__ = ["CoordinatorHandle", "aconnect", "connect"]
