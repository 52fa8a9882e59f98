"""The policy model participant: admission gate, held responses, cuts, ledger.

What a policy model holds for a checkpoint (reference notes §2.1):

- **Admission**: once a checkpoint closes, new calls are refused with
  `admission_closed`; the caller retries after resume.
- **Held response starts**: a call admitted before the close keeps generating,
  but its response is not delivered until resume.  Only responses already
  being delivered block prepare, so prepare never waits for a generation.
- **Undelivered calls are left out of the ledger**: their caller is still at
  its pre-call boundary and re-issues the call after a restore.
- **Generation cuts**: at close, each episode's latest undelivered generation
  is cut at a token boundary and its prefix staged for the attempt.  After a
  restore, the re-issued call of attempt + 1 with the same conversation digest
  continues from the prefix instead of generating it again.  Best effort: a
  missing or unmatched cut only costs regeneration.
- **Capture ledger**: one row per delivered call, per attempt; exported for
  the commit scope and imported under attempt + 1.  Retire frees the ledgers
  (and cuts and held calls) of the attempt and every earlier one.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from participants.hooks import stage_records, stop_tasks
from ray_ckpt.control.admission import AdmissionGate
from ray_ckpt.control.retire_marks import retire_scope
from ray_ckpt.control.wire import Blocker, PrepareReport, to_builtins
from ray_ckpt.errors import AdmissionClosed, InvalidCheckpointState
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.record import Record


class Cut(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A generation cut at a token boundary: the prefix and what it belongs to."""

    digest: str  # the conversation the generation answers
    tokens: list[int]
    call: int  # admission index of the cut call (diagnostics only)


class ModelState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One record's state: the attempt's ledger rows and its cut, if any."""

    rows: list[dict[str, Any]]
    cut: Cut | None = None


class Call:
    """One admitted generation, from admission to delivery."""

    __slots__ = ("continued", "delivering", "digest", "episode", "index", "task", "tokens")

    def __init__(self, episode: EpisodeId, digest: str, index: int, task: Any) -> None:
        self.episode = episode
        self.digest = digest
        self.index = index
        self.task: asyncio.Task[Any] | None = task
        self.tokens: list[int] = []
        self.continued = 0  # tokens taken from a restored cut
        self.delivering = False


class PolicyModelParticipant:
    kind = "model"

    def __init__(self) -> None:
        self.calls: dict[int, Call] = {}
        self.ledger: dict[EpisodeId, list[dict[str, Any]]] = {}
        self.cuts: dict[EpisodeId, Cut] = {}  # staged by the open checkpoint
        self.restored_cuts: dict[EpisodeId, Cut] = {}  # for the re-issued call of a + 1
        self.restored: set[EpisodeId] = set()  # installed, no call seen yet
        self.counts: Counter[str] = Counter()
        self.gate = AdmissionGate()
        self._served = False
        self._installed = False
        self._next_index = 0
        self._notify: Callable[[], None] = lambda: None

    # --- controller side -----------------------------------------------------
    def bind(self, notify: Callable[[], None]) -> None:
        self._notify = notify

    def close_admission(self) -> None:
        self.gate.close()
        self.cuts = self._cut_generations()
        self._notify()

    def open_admission(self) -> None:
        # The cut generations keep running and deliver now: their cuts are moot.
        self.cuts = {}
        self.gate.open()
        self._notify()

    def _cut_generations(self) -> dict[EpisodeId, Cut]:
        latest: dict[EpisodeId, Call] = {}
        for call in self.calls.values():
            if call.delivering:
                continue  # delivered before the checkpoint: it goes to the ledger
            held = latest.get(call.episode)
            if held is None or call.index > held.index:
                latest[call.episode] = call
        cuts = {}
        for episode, call in latest.items():
            if not call.tokens:
                self.counts["cut_skipped"] += 1
                continue
            cuts[episode] = Cut(call.digest, list(call.tokens), call.index)
            self.counts["cut"] += 1
        return cuts

    def ready(self) -> bool:
        return not any(call.delivering for call in self.calls.values())

    def report(self, limit: int) -> PrepareReport:
        delivering = sorted(
            (c for c in self.calls.values() if c.delivering), key=lambda c: c.episode.capture_key
        )
        return PrepareReport(
            ready=not delivering,
            blockers=[
                Blocker(key=c.episode.capture_key, state="streaming", detail=f"call-{c.index}")
                for c in delivering[: max(limit, 0)]
            ],
            blocker_count=len(delivering),
            counts={
                "calls": len(self.calls),
                "held": sum(1 for c in self.calls.values() if not c.delivering),
                "ledgers": len(self.ledger),
                "cuts": len(self.cuts),
                "restored": len(self.restored),
            },
        )

    def live_executions(self) -> int:
        return len(self.calls)

    def fresh(self) -> bool:
        return not self._served and not self._installed

    async def export(self, scope: Sequence[EpisodeId] | None) -> list[Record]:
        keys: Iterable[EpisodeId] = (
            scope
            if scope is not None
            else {*self.ledger, *self.cuts, *self.restored_cuts, *self.restored}
        )
        records = []
        for episode in dict.fromkeys(keys):
            rows = self.ledger.get(episode, [])
            cut = self.cuts.get(episode) or self.restored_cuts.get(episode)
            if rows or cut is not None or episode in self.restored:
                state = ModelState(rows=list(rows), cut=cut)
                records.append(Record(episode.capture_key, to_builtins(state)))
        records.sort(key=lambda r: r.key)
        return records

    async def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        def parse(record: Record) -> ModelState:
            try:
                return msgspec.convert(record.state, ModelState)
            except msgspec.ValidationError as exc:
                raise InvalidCheckpointState(f"model record {record.key!r}: {exc}") from None

        staged = stage_records(records, parse)
        for episode, state in staged.items():
            self.ledger[episode] = list(state.rows)
            if state.cut is not None:
                self.restored_cuts[episode] = state.cut
            self.restored.add(episode)
        self._installed = True
        self._notify()
        return list(staged)

    async def retire(self, episode_ids: Sequence[EpisodeId]) -> list[str]:
        covered = retire_scope(episode_ids)

        stopping = [c for c in self.calls.values() if covered(c.episode)]
        keys = {c.episode.capture_key for c in stopping}
        await stop_tasks(c.task for c in stopping)
        for table in (self.ledger, self.cuts, self.restored_cuts):
            for episode in [e for e in table if covered(e)]:
                keys.add(episode.capture_key)
                del table[episode]
        for episode in [e for e in self.restored if covered(e)]:
            keys.add(episode.capture_key)
            self.restored.discard(episode)
        for index in [i for i, c in self.calls.items() if covered(c.episode)]:
            del self.calls[index]
        self._notify()
        return sorted(keys)

    async def delete_restored(self, keep: Sequence[EpisodeId]) -> list[str]:
        kept = set(keep)
        freed = sorted(e for e in self.restored if e not in kept)
        for episode in freed:
            self.restored.discard(episode)
            self.ledger.pop(episode, None)
            self.restored_cuts.pop(episode, None)
        return [e.capture_key for e in freed]

    # --- data plane ----------------------------------------------------------
    def admit(self, episode: EpisodeId, digest: str) -> Call:
        """Admit one call (or refuse it while a checkpoint is open)."""
        if not self.gate.is_open:
            raise AdmissionClosed(f"policy model: a checkpoint is in progress ({episode})")
        self._served = True
        self.restored.discard(episode)
        call = Call(episode, digest, self._next_index, asyncio.current_task())
        self._next_index += 1
        cut = self.restored_cuts.pop(episode, None)
        if cut is not None:
            if cut.digest == digest:
                call.tokens = list(cut.tokens)
                call.continued = len(cut.tokens)
                self.counts["calls_continued"] += 1
            else:
                self.counts["cut_unmatched"] += 1
        self.calls[call.index] = call
        self._notify()
        return call

    async def hold(self, call: Call) -> None:
        """Hold the response start while a checkpoint is open."""
        await self.gate.wait_open()
        # No await between here and `deliver`: a close cannot slip in between.

    def deliver(self, call: Call) -> None:
        call.delivering = True
        self._notify()

    def delivered(self, call: Call, row: dict[str, Any]) -> None:
        self.ledger.setdefault(call.episode, []).append(row)
        self.drop(call)

    def drop(self, call: Call) -> None:
        if self.calls.pop(call.index, None) is not None:
            call.delivering = False
            self._notify()
