"""Injected time.

Deadlines on the wire are absolute Unix-epoch seconds, so every clock reports
wall time.  Leases, deadlines and parked time read a `Clock`; tests use
`ManualClock` and advance it to assert exact expiry.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the Unix epoch."""
        ...


class SystemClock:
    def now(self) -> float:
        return time.time()


class ManualClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self._now += seconds

    def set(self, when: float) -> None:
        if when < self._now:
            raise ValueError("a clock does not go backwards")
        self._now = when


SYSTEM_CLOCK = SystemClock()
