"""Pieces the participant hooks of every kind share: staging restored records
under attempt + 1, and stopping an attempt's tasks on retire."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ray_ckpt.errors import InvalidCheckpointState, InvalidRequest
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.records.record import Record

T = TypeVar("T")


def stage_records(records: Sequence[Record], parse: Callable[[Record], T]) -> dict[EpisodeId, T]:
    """Validate every record (its key, its state through `parse`, one per rollout)
    and return the states keyed by attempt + 1; installs nothing."""
    staged: dict[EpisodeId, T] = {}
    rollouts: set[str] = set()  # a set, so the check stays linear in the records
    for record in records:
        try:
            episode = EpisodeId.from_capture_key(record.key)
        except InvalidRequest as exc:
            raise InvalidCheckpointState(f"record key: {exc.detail}") from None
        state = parse(record)
        if episode.rollout_id in rollouts:
            raise InvalidCheckpointState(f"rollout {episode.rollout_id} is restored twice")
        rollouts.add(episode.rollout_id)
        staged[episode.next()] = state
    return staged


async def stop_tasks(tasks: Iterable[asyncio.Task[Any] | None]) -> None:
    """Cancel the tasks still running (never the caller's own) and wait until they end."""
    me = asyncio.current_task()
    stopping = [t for t in tasks if t is not None and not t.done() and t is not me]
    for task in stopping:
        task.cancel()
    if stopping:
        # asyncio.wait, not gather: cancelling us must not cancel them again.
        await asyncio.wait(stopping)
