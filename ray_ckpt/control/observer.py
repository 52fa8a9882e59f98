"""What a engine tells its host about itself, for the host's metrics.

The engine knows nothing of Ray: the host (a Ray actor) plugs in an
observer that turns these calls into `ray.util.metrics` observations
(`ray_ckpt.hosting.metrics`); without one the engine skips the timing.
"""

from __future__ import annotations

from typing import Protocol


class ControlObserver(Protocol):
    def call_done(self, op: str, seconds: float, outcome: str, writes_in_flight: int) -> None:
        """One control call answered (`outcome`: ok or failed)."""

    def lease_expired(self) -> None:
        """The coordinator's lease ran out and the engine resumed by itself."""
