"""Helpers for tests that kill Ray actors.

ray.kill returns once the GCS has marked the actor dead (its name is free
then), but the actor's process is stopped after that: a call sent right
after the kill can still be delivered and answered (a CI run saw exactly
that).  A test that needs calls to fail polls for the death first.
"""

from __future__ import annotations

import asyncio
import time

from ray.exceptions import RayActorError


async def until_dead(handle: object, *, method: str = "ready", attempts: int = 300) -> None:
    """Return once calls to a killed actor fail."""
    for _ in range(attempts):
        try:
            await asyncio.wait_for(getattr(handle, method).remote(), 30)
        except RayActorError:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the killed actor still answers")


def wait_dead(handle: object, *, method: str = "status", timeout_s: float = 30.0) -> None:
    """`until_dead` for synchronous tests."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(getattr(handle, method).remote(), timeout=30)
        except RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("the killed actor still answers")
