"""Calling the coordinator actor: one place that turns Ray's failures into ours.

The handle's methods are a flat API of sync/async twins; each goes through
`CoordinatorCalls`, so a remote `CheckpointError` arrives as the project's own
class with its own message (never Ray's dual-class wrapper whose `str()` is
the remote traceback), and a dead coordinator as `ParticipantUnavailable`.
The episode arguments every method takes are normalised here too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from coordination.hosts import _unwrap_ray_error
from coordination.periodic import episode_list
from ray_ckpt.identity import EpisodeId

EpisodeLike = EpisodeId | str | tuple[str, int]


def episodes(items: Iterable[EpisodeLike] | None) -> list[EpisodeId] | None:
    """EpisodeIds from EpisodeIds, capture keys (`r`, `r-a2`) or (rollout, attempt)."""
    return None if items is None else episode_list(items)


def restore_args(
    episode_ids: Iterable[EpisodeLike] | Literal["latest"] | None, latest: bool
) -> tuple[list[EpisodeId] | None, bool]:
    """(episodes, latest) of `restore(where, episode_ids)`: `"latest"` reads
    `where` as a root and restores every episode its newest checkpoint holds."""
    if episode_ids == "latest":
        return None, True
    return episodes(episode_ids), latest


class CoordinatorCalls:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def sync(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray

        try:
            return ray.get(getattr(self.actor, method).remote(*args, **kwargs))
        except Exception as exc:
            # No `except CheckpointError: raise` first: Ray's `RayTaskError`
            # for a remote CheckpointError is also an instance of it (a
            # dual-class wrapper whose str() is the remote traceback).
            raise _unwrap_ray_error(exc, f"coordinator {method}") from None

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await getattr(self.actor, method).remote(*args, **kwargs)
        except Exception as exc:
            raise _unwrap_ray_error(exc, f"coordinator {method}") from None
