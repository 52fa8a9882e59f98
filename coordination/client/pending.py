"""What `checkpoint(..., durability="async")` returns: resumed, not yet durable.

`durable()` (and `adurable()`) wait on a Ray object ref of the coordinator's
`durable(checkpoint_id)` call, taken as soon as the checkpoint returned, so
a driver can drop the object and still find out later from the coordinator
(`handle.durable(checkpoint_id)`).  The trainer publishes its own global
checkpoint after `durable()`: before it, a crash leaves this one
unpublished and the previous one restorable.
"""

from __future__ import annotations

from typing import Any

from coordination.engine.results import CheckpointResult, DurableResult
from coordination.reach.hosts import _unwrap_ray_error


class PendingCheckpoint:
    def __init__(self, result: CheckpointResult, ref: Any) -> None:
        self.result = result  # as of the resume: what was captured, continued, restarted
        self._ref = ref

    @property
    def checkpoint_id(self) -> str:
        return self.result.checkpoint_id

    def durable(self, timeout_s: float | None = None) -> DurableResult:
        """Block until every participant is durable and the Gym manifest is
        written; raises the write's failure (`CoordinationFailed`), or
        `TimeoutError` after `timeout_s` (the checkpoint goes on)."""
        import ray

        try:
            done: DurableResult = ray.get(self._ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{self.checkpoint_id} not durable within {timeout_s}s") from None
        except Exception as exc:
            raise _unwrap_ray_error(exc, "coordinator durable") from None
        return done

    async def adurable(self) -> DurableResult:
        try:
            done: DurableResult = await self._ref
        except Exception as exc:
            raise _unwrap_ray_error(exc, "coordinator durable") from None
        return done

    def done(self) -> bool:
        """True once `durable()` would return or raise without waiting."""
        import ray

        ready, _ = ray.wait([self._ref], timeout=0)
        return bool(ready)

    def __repr__(self) -> str:
        return f"PendingCheckpoint({self.checkpoint_id}, done={self.done()})"
