"""Small helpers shared by the unit tests of every folder: control bodies and polling."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

# Where the tests' manual clocks start (`ManualClock(T0)`), and so where
# `body_t0`'s deadlines are counted from.
T0 = 1_000_000.0


def body(cid: str, deadline: float = 20.0, **extra: Any) -> dict[str, Any]:
    """A control body for checkpoint `cid`, its deadline `deadline` s ahead on
    the wall clock (for a engine on the system clock)."""
    return {"checkpoint_id": cid, "deadline_ts": time.time() + deadline, **extra}


def body_t0(cid: str, deadline: float = 30.0, **extra: Any) -> dict[str, Any]:
    """A control body for checkpoint `cid`, its deadline `deadline` s after
    `T0` (for a engine on `ManualClock(T0)`: the wall clock means nothing to it)."""
    return {"checkpoint_id": cid, "deadline_ts": T0 + deadline, **extra}


async def until(pred: Callable[[], object], timeout: float = 10.0) -> None:
    # Polls: the predicates read server counters that no event covers.
    async with asyncio.timeout(timeout):
        while True:
            if pred():
                return
            await asyncio.sleep(0.002)
