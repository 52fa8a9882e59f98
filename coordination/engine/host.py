"""What the engine needs of a participant and of a paused caller: protocols.

The engine (`coordination.engine.coordinator_core`) drives these and nothing else; how a call
reaches a participant — a Ray actor, the HTTP control routes, an in-process
double — is `coordination.reach.hosts`, a room above it.  A call either returns
the participant's reply as plain builtins or raises a `CheckpointError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from coordination.engine.order import Member


class Host(Protocol):
    member: Member
    # True once a call found the participant gone for good (its actor died);
    # the driver then drops it from the members.  Never set for a participant
    # that is only unreachable (it may come back).
    gone: bool

    async def call(self, op: str, body: Mapping[str, Any]) -> dict[str, Any]: ...

    async def status(self) -> dict[str, Any]: ...

    def describe(self) -> dict[str, Any]:
        """How to find this participant again (journalled; never a secret)."""
        ...

    async def aclose(self) -> None: ...


class ControlTarget(Protocol):
    async def handle(self, op: str, body: dict[str, Any]) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any]: ...


class PauseTarget(Protocol):
    role: str  # "trainer" or "assembler"

    async def pause(self, checkpoint_id: str, deadline_s: float) -> Any: ...

    async def resume(self, checkpoint_id: str) -> Any: ...
