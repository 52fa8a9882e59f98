"""`RestoredEntries`: a server's restored episodes and its closed window's losses.

Separate from the live table (`table.py`) because these entries outlive the
attempts around them: a restore installs them before any episode begins, a
replacement attempt shares its entry until it records a boundary of its own,
and a commit exports the entries whose replacement has not begun, so a
second crash still continues them.  The closed-window sets live here too:
only the export asks whether an episode in scope was held here during this
checkpoint and then lost (`EpisodeNotHeld`).

Every entry holds its attempt's slot in the table's `AttemptIndex` (shared,
not owned): a live replacement takes the slot over when its entry goes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from ray_ckpt.identity import EpisodeId
from ray_ckpt.steps.attempts import AttemptIndex
from ray_ckpt.steps.episode import Episode, Restored
from ray_ckpt.steps.persist import EpisodeNotHeld, stage_records
from ray_ckpt.storage.records.record import Record

Live = Mapping[EpisodeId, Episode]


class RestoredEntries:
    """Installed entries by the replacement attempt.  Not thread-safe: one loop."""

    def __init__(self, attempts: AttemptIndex) -> None:
        self.entries: dict[EpisodeId, Restored] = {}
        self._attempts = attempts
        # Episodes live at any moment of the current closed window; an
        # episode named by a commit's scope that one of these no longer
        # holds lost its capture, and the commit must say so.
        self._served_closed: set[EpisodeId] = set()
        self._retired_closed: set[EpisodeId] = set()

    def get(self, eid: EpisodeId) -> Restored | None:
        return self.entries.get(eid)

    def waiting(self, live: Live) -> list[EpisodeId]:
        """Entries whose replacement has not begun, sorted."""
        return sorted(eid for eid in self.entries if eid not in live)

    def waiting_count(self, live: Live) -> int:
        return sum(1 for eid in self.entries if eid not in live)

    # --- the closed window -------------------------------------------------------

    def window_closed(self, live: Iterable[EpisodeId]) -> None:
        """A checkpoint closed admission: start counting what it served."""
        self._served_closed = set(live)
        self._retired_closed = set()

    def served(self, eid: EpisodeId) -> None:
        self._served_closed.add(eid)

    def retired(self, eid: EpisodeId) -> None:
        self._retired_closed.add(eid)

    def check_held(self, scope: Sequence[EpisodeId], live: Live) -> None:
        for eid in scope:
            if (
                eid in self._served_closed
                and eid not in live
                and eid not in self.entries
                and eid not in self._retired_closed
            ):
                raise EpisodeNotHeld(
                    f"episode {eid.capture_key} was served during this checkpoint but is no "
                    "longer held here: its capture is lost"
                )

    # --- install and free --------------------------------------------------------

    def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        """Validate every record, then install each under attempt + 1."""
        staged = stage_records(records, {eid.rollout_id for eid in self.entries})
        self.entries.update(staged)
        for eid in staged:
            self._attempts.add(eid)
        return list(staged)

    def spend(self, ep: Episode) -> None:
        """The episode recorded a boundary of its own: its restored entry is spent."""
        if ep.on_restored:
            ep.on_restored = False
            if self.entries.get(ep.id) is ep._restored:
                del self.entries[ep.id]  # the live attempt keeps the attempt slot

    def holds(self, ep: Episode) -> bool:
        """The episode still stands on its installed entry (it moved on from nothing)."""
        restored = ep._restored
        return ep.on_restored and restored is not None and self.entries.get(ep.id) is restored

    def delete(self, keep: Sequence[EpisodeId], live: Live) -> list[str]:
        """Free the entries not named in `keep`; their capture keys, sorted."""
        kept = set(keep)
        freed = [eid for eid in self.entries if eid not in kept]
        self._drop(freed, live)
        return sorted(eid.capture_key for eid in freed)

    def retire(self, covered: Callable[[EpisodeId], bool], live: Live) -> set[str]:
        """Free the entries a retire covers; their capture keys."""
        freed = [eid for eid in self.entries if covered(eid)]
        self._drop(freed, live)
        return {eid.capture_key for eid in freed}

    def _drop(self, freed: Iterable[EpisodeId], live: Live) -> None:
        for eid in freed:
            del self.entries[eid]
            ep = live.get(eid)
            if ep is not None:
                ep.on_restored = False  # its live attempt keeps (and frees) the slot
            else:
                self._attempts.remove(eid)
