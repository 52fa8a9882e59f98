"""The resources participant of a wrapped NeMo Gym server: episodes that are
over keep their state with the server until the caller frees it.

A `/verify`, or a `/step` that answers ``terminated``/``truncated``, ends the
episode: it is no longer live, so a checkpoint neither exports it nor reports
it as a restart.  Its state is not freed then, because the wrapper never
changes a server's own replies: a bare `GymnasiumServer` answers a later
`/step` with its last ``terminated`` reply (say Sokoban's, from its kept
session state), and a counter answers its count after `/verify`; freeing the
state at that moment would turn those into ``400 Session not initialized``
or a fresh count.  The server frees what it frees by itself (a
`GymnasiumServer`'s own `close_session` at the terminal step); the rest is
freed when the caller says the episode is done with: `/close_session`, or a
retire of its rollout.  Until then it costs what it costs the bare server,
which keeps every session its callers never close.
"""

from __future__ import annotations

from collections.abc import Sequence

from participants.resources import ResourcesMode, ResourcesParticipant, SessionHooks
from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import PrepareReport
from ray_ckpt.steps.retire_marks import retire_scope


class WrappedResources(ResourcesParticipant):
    """`ResourcesParticipant` plus the finished episodes whose state the server still holds."""

    def __init__(
        self, hooks: SessionHooks, *, mode: ResourcesMode | str = ResourcesMode.RESTART_ONLY
    ) -> None:
        super().__init__(hooks, mode=mode)
        self.finished: set[EpisodeId] = set()

    def finish_session(self, episode: EpisodeId) -> None:
        """The episode is over: out of every checkpoint, its state left to the server."""
        if episode not in self.sessions:
            # Never seeded here (a stateless verifier's `/verify`), or finished
            # already: nothing of ours to track, so nothing grows per call.
            return
        self.sessions.discard(episode)
        self.restored.discard(episode)
        self.finished.add(episode)
        self._notify()

    def bind_session(self, episode: EpisodeId) -> None:
        # A new seed (`/reset`) of the same attempt makes it live again.
        self.finished.discard(episode)
        super().bind_session(episode)

    async def end_session(self, episode: EpisodeId) -> bool:
        finished = episode in self.finished
        self.finished.discard(episode)
        return await super().end_session(episode) or finished

    async def retire(self, episode_ids: Sequence[EpisodeId]) -> list[str]:
        keys = set(await super().retire(episode_ids))
        covered = retire_scope(episode_ids)
        for episode in sorted(e for e in self.finished if covered(e)):
            await self.hooks.retire_session_state(episode)
            self.finished.discard(episode)
            keys.add(episode.capture_key)
        return sorted(keys)

    def report(self, limit: int) -> PrepareReport:
        report = super().report(limit)
        report.counts["finished"] = len(self.finished)
        return report
