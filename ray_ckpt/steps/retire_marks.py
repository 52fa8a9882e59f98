"""Per-rollout refusal marks raised by retire and dropped by forget.

A retire raises the mark before it stops anything and never lowers it: a data
call that its caller sent just before the caller's own retire can arrive after
this server's retire finished, and must still be refused (`stale_attempt`).
`forget` drops the marks of finished rollouts so no table grows with the job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ray_ckpt.errors import StaleAttempt
from ray_ckpt.identity import EpisodeId


class RetiredAttempts:
    def __init__(self) -> None:
        self._marks: dict[str, int] = {}
        # The rollouts a retire named, until forget: what `status.retired_rollouts`
        # counts, as NeMo Gym's participants count it.  A restore's fence
        # (`fence`) refuses the same way but retires nothing, so it is not here.
        self._retired: set[str] = set()

    def mark(self, episode: EpisodeId) -> None:
        """A retire's mark: refuse attempts up to this one, and count the rollout retired."""
        self.fence(episode)
        self._retired.add(episode.rollout_id)

    def fence(self, episode: EpisodeId) -> None:
        """Refuse attempts up to this one until forget, without counting the
        rollout as retired (a restore fences the attempts it replaced)."""
        previous = self._marks.get(episode.rollout_id, -1)
        self._marks[episode.rollout_id] = max(previous, episode.attempt)

    def retired_rollouts(self) -> int:
        """Rollouts retired by a retire call and not forgotten since."""
        return len(self._retired)

    def is_retired(self, episode: EpisodeId) -> bool:
        mark = self._marks.get(episode.rollout_id)
        return mark is not None and episode.attempt <= mark

    def check(self, episode: EpisodeId) -> None:
        """Refuse a data call for a retired attempt."""
        if self.is_retired(episode):
            raise StaleAttempt(
                f"attempt {episode.capture_key} was retired "
                f"(rollout {episode.rollout_id} retired up to attempt "
                f"{self._marks[episode.rollout_id]})"
            )

    def forget(self, rollout_ids: Iterable[str]) -> list[str]:
        rollouts = set(rollout_ids)
        self._retired -= rollouts
        return sorted(r for r in rollouts if self._marks.pop(r, None) is not None)

    def __len__(self) -> int:
        return len(self._marks)


def retire_scope(episode_ids: Iterable[EpisodeId]) -> Callable[[EpisodeId], bool]:
    """Which attempts a retire of `episode_ids` covers: every attempt up to the
    named one of each named rollout (a retire stops earlier attempts too)."""
    limits: dict[str, int] = {}
    for e in episode_ids:
        limits[e.rollout_id] = max(limits.get(e.rollout_id, -1), e.attempt)

    def covered(e: EpisodeId) -> bool:
        return e.attempt <= limits.get(e.rollout_id, -1)

    return covered
