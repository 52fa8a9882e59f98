"""The participant hooks: what one kind of Gym server implements.

The engine (phase machine, fencing, lease, storage) is the same for every
server; a participant supplies what only its kind knows: how to close and open
admission, whether its live executions are at a boundary, what to export for
a scope, how to install restored records under attempt + 1, and how to stop
and free an attempt.  Participants call the `notify` callback the engine
hands them whenever readiness may have changed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import PrepareReport
from ray_ckpt.storage.records.record import Record

KINDS = ("environment", "model", "agent", "resources")


@runtime_checkable
class Participant(Protocol):
    """Required hooks, and optional ones the engine looks up by name:

    - `async park_exported(records)`: called after a durable commit with
      `stop=true` (the engine stops instead of resuming) to free external
      compute such as sandboxes, inside the commit's deadline; failures are
      only logged, a missed deadline fails the commit for a retry to park again.
    - `retiring() -> int`: how many attempts are being stopped right now,
      reported as `status.retiring` (stops that outlive a cancelled retire
      call included).  Without it the engine counts the distinct attempts
      named by the retire calls in flight.
    """

    kind: str

    def bind(self, notify: Callable[[], None]) -> None:
        """Receive the engine's change callback (called once, at install)."""
        ...

    def close_admission(self) -> None:
        """Stop admitting new executions (they wait or are refused until open)."""
        ...

    def open_admission(self) -> None:
        """Reopen admission; parked work continues."""
        ...

    def ready(self) -> bool:
        """Cheap: is every live execution at a boundary?"""
        ...

    def report(self, limit: int) -> PrepareReport:
        """Readiness with blockers (at most `limit` listed; the count is full)."""
        ...

    def live_executions(self) -> int: ...

    def fresh(self) -> bool:
        """True in a process that has not served any execution (restore needs it)."""
        ...

    async def export(self, scope: Sequence[EpisodeId] | None) -> list[Record]:
        """Records for the episodes to continue (all live ones when scope is None)."""
        ...

    async def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        """Validate every record, then install each under attempt + 1.

        Installs nothing if any record is invalid; returns the next attempts.
        Raise `InvalidCheckpointState` for a bad record; any other exception
        (a `TypeError` from a user's setstate) is reported as that too.  After
        a failure, or when the install is cancelled (a lapsed lease), the
        engine calls `delete_restored(())` to free whatever it left, so
        the install may be interrupted at any await.  Once it succeeds, the
        engine refuses attempts <= N of each installed rollout
        (`stale_attempt`) until `forget`.
        """
        ...

    async def retire(self, episode_ids: Sequence[EpisodeId]) -> list[str]:
        """Stop every attempt <= the given one of each rollout, wait, free.

        Returns the capture keys of what was stopped or freed.
        """
        ...

    async def delete_restored(self, keep: Sequence[EpisodeId]) -> list[str]:
        """Free restored-but-unclaimed state whose next attempt is not in `keep`."""
        ...
