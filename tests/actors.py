"""Helpers for tests that kill Ray actors."""

from __future__ import annotations

import asyncio

from ray.exceptions import RayActorError


async def until_dead(handle: object, *, attempts: int = 300) -> None:
    """Return once calls to a killed actor fail.

    ray.kill only asks the GCS to kill the actor: a call sent right after it
    can still be delivered and answered (a CI run saw exactly that), so a
    test polls for the death instead of asserting the very next call fails.
    """
    for _ in range(attempts):
        try:
            await asyncio.wait_for(handle.ready.remote(), 30)  # type: ignore[attr-defined]
        except RayActorError:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the killed actor still answers")
