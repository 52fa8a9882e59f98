"""Which attempts of each rollout a server holds, live or restored.

`EpisodeSteps.begin` refuses an attempt older than the newest one held for its
rollout (`stale_attempt`); counting attempts per rollout answers that without
scanning every episode.
"""

from __future__ import annotations

from collections import Counter

from ray_ckpt.identity import EpisodeId


class AttemptIndex:
    def __init__(self) -> None:
        self._by_rollout: dict[str, Counter[int]] = {}

    def add(self, eid: EpisodeId) -> None:
        self._by_rollout.setdefault(eid.rollout_id, Counter())[eid.attempt] += 1

    def remove(self, eid: EpisodeId) -> None:
        attempts = self._by_rollout.get(eid.rollout_id)
        if attempts is None:
            return
        attempts[eid.attempt] -= 1
        if attempts[eid.attempt] <= 0:
            del attempts[eid.attempt]
        if not attempts:
            del self._by_rollout[eid.rollout_id]

    def newest(self, rollout_id: str) -> int:
        """The newest attempt held for the rollout, -1 when none is."""
        return max(self._by_rollout.get(rollout_id, ()), default=-1)
