"""Coordination: participant order, the Coordinator actor, the handle, the CLI."""
