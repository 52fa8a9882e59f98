"""A `Participant` for any server whose executions are `EpisodeSteps` episodes.

Environment servers and agent servers that track their work with
`EpisodeSteps` get the participant hooks by delegation; a kind that holds more
state (sessions, ledgers) wraps this one and adds its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import PrepareReport
from ray_ckpt.steps import EpisodeSteps
from ray_ckpt.storage.records.record import Record


class EpisodeParticipant:
    """Delegates every participant hook to one `EpisodeSteps`."""

    def __init__(self, kind: str, steps: EpisodeSteps) -> None:
        self.kind = kind
        self.steps = steps

    def bind(self, notify: Callable[[], None]) -> None:
        self.steps.bind(notify)

    def close_admission(self) -> None:
        self.steps.close_admission()

    def open_admission(self) -> None:
        self.steps.open_admission()

    def ready(self) -> bool:
        return self.steps.ready()

    def report(self, limit: int) -> PrepareReport:
        return self.steps.report(limit)

    def live_executions(self) -> int:
        return self.steps.live_executions()

    def live_keys(self) -> list[str]:
        """The capture keys of the live episodes (`status`: what is in flight)."""
        return [e.key for e in self.steps.episodes()]

    def fresh(self) -> bool:
        return self.steps.fresh()

    def retiring(self) -> int:
        return self.steps.retiring()

    async def export(self, scope: Sequence[EpisodeId] | None) -> list[Record]:
        # The episodes are this server's only state: one gone from the
        # scope's checkpoint is a lost capture, never a silent omission.
        return self.steps.export(scope, require_held=True)

    async def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        return self.steps.install(records)

    async def retire(self, episode_ids: Sequence[EpisodeId]) -> list[str]:
        return await self.steps.retire(episode_ids)

    async def delete_restored(self, keep: Sequence[EpisodeId]) -> list[str]:
        return self.steps.delete_restored(keep)
