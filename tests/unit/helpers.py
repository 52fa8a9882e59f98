"""Small helpers shared by the in-process participant tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


def body(cid: str, **extra: Any) -> dict[str, Any]:
    """A control body for checkpoint `cid` with a deadline 20 s ahead."""
    return {"checkpoint_id": cid, "deadline_ts": time.time() + 20, **extra}


async def until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    # Polls: the predicates read server counters that no event covers.
    async with asyncio.timeout(timeout):
        while True:
            if pred():
                return
            await asyncio.sleep(0.002)
