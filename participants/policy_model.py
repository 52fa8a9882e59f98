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
  restore, the re-issued call of attempt + 1 continues from the prefix instead
  of generating it again, but only if it asks for the same generation: the
  same conversation digest *and* the same generation parameters (limits,
  sampling, stop sequences, tool choice, constrained decoding), and a limit
  the prefix does not exceed.  A call that does not match leaves the cut for
  a later one that does.  Best effort: a missing or unmatched cut only costs
  regeneration.
- **Capture ledger**: one row per delivered call, per attempt; exported for
  the commit scope only (notes §1.10: export without a scope is refused) and
  imported under attempt + 1.  A row is keyed by the caller's call position
  (the `x-ng-model-call` header: how many model calls the caller's session
  had made before this one), so a call the caller re-issues after a restore
  (its response was delivered, but the caller's exported boundary is before
  the call) replaces the row of the dropped delivery instead of adding a
  second one: the ledger always ends equal to the caller's boundary.
- **Bounded**: the ledger frees an attempt when its caller closes it
  (`finish`, the episode is done), when it is retired, when its rollout is
  forgotten, and when a commit leaves a restored attempt out of its scope.
  With checkpointing off nothing is recorded at all.
- **Fence**: a retired attempt never gains a call, a cut or a ledger row, even
  if its request was still arriving when the retire ran.

This module is the participant: its tables, the admission gate and when
anything is added or freed.  The call and cut types and the cut rules are in
`participants.model_calls`; how a ledger row lands and what a record holds
in `participants.model_ledger`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from participants.hooks import stage_records, stop_tasks
from participants.model_calls import Call, Cut, continue_restored, cut_generations
from participants.model_ledger import Row, add_row, export_records, parse_state
from ray_ckpt.control.admission import AdmissionGate
from ray_ckpt.errors import AdmissionClosed, InvalidRequest, StaleAttempt
from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import Blocker, PrepareReport
from ray_ckpt.steps.retire_marks import retire_scope
from ray_ckpt.storage.records.record import Record


def _covers_rollouts(rollout_ids: Iterable[str]) -> Callable[[EpisodeId], bool]:
    ids = frozenset(rollout_ids)
    return lambda e: e.rollout_id in ids


class PolicyModelParticipant:
    kind = "model"

    def __init__(self, *, recording: bool = True) -> None:
        self.calls: dict[int, Call] = {}
        self.ledger: dict[EpisodeId, list[Row]] = {}
        self.cuts: dict[EpisodeId, Cut] = {}  # staged by the open checkpoint
        self.restored_cuts: dict[EpisodeId, Cut] = {}  # for the re-issued call of a + 1
        self.restored: set[EpisodeId] = set()  # installed, no call seen yet
        self.finishing: set[EpisodeId] = set()  # closed while a checkpoint is open
        self.counts: Counter[str] = Counter()
        self.gate = AdmissionGate()
        # With checkpointing off (no engine) the server passes False:
        # nothing is recorded, so nothing can grow.
        self.recording = recording
        # The engine's retire marks (the server wires them in at attach).
        self.retired: Callable[[EpisodeId], bool] = lambda episode: False
        # Called with a finished attempt's rows as they are freed: where a
        # trainer's collector takes the trajectory (NeMo Gym's token store).
        self.collect: Callable[[EpisodeId, list[Row]], None] | None = None
        self._served = False
        self._installed = False
        self._next_index = 0
        self._notify: Callable[[], None] = lambda: None

    # --- engine side -----------------------------------------------------
    def bind(self, notify: Callable[[], None]) -> None:
        self._notify = notify

    def close_admission(self) -> None:
        self.gate.close()
        self.cuts = cut_generations(self.calls.values(), self.retired, self.counts)
        self._notify()

    def open_admission(self) -> None:
        # The cut generations keep running and deliver now: their cuts are moot.
        self.cuts = {}
        self.gate.open()
        # Attempts closed during the checkpoint were kept for its export.
        finishing, self.finishing = self.finishing, set()
        for episode in sorted(finishing, key=lambda e: e.capture_key):
            self._finish_now(episode)
        self._notify()

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

    def live_keys(self) -> list[str]:
        return sorted({c.episode.capture_key for c in self.calls.values()})

    # Its export needs a named scope (see `export`): `status` says so, and a
    # checkpoint with no scope and no assembler to ask is refused up front.
    needs_scope = True

    def fresh(self) -> bool:
        return not self._served and not self._installed

    def table_sizes(self) -> dict[str, int]:
        """Entries of every per-episode table (all return to 0 when nothing is live)."""
        return {
            "calls": len(self.calls),
            "ledgers": len(self.ledger),
            "ledger_rows": sum(len(rows) for rows in self.ledger.values()),
            "cuts": len(self.cuts),
            "restored_cuts": len(self.restored_cuts),
            "restored": len(self.restored),
            "finishing": len(self.finishing),
        }

    async def export(self, scope: Sequence[EpisodeId] | None) -> list[Record]:
        if scope is None:
            # Notes §1.10: the ledger holds every episode it ever served, so
            # "everything" is never what a checkpoint means.
            raise InvalidRequest(
                "the policy model exports only a named scope: the commit needs episode_ids"
            )
        return export_records(scope, self.ledger, self.cuts, self.restored_cuts, self.restored)

    async def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        staged = stage_records(records, parse_state)
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
        for call in stopping:
            call.finished = True
        keys = {c.episode.capture_key for c in stopping}
        await stop_tasks(c.task for c in stopping)
        keys.update(self._free(covered))
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
        self._notify()
        return [e.capture_key for e in freed]

    def forget(self, rollout_ids: Sequence[str]) -> list[str]:
        """Free every attempt of rollouts the engine is done with."""
        covered = _covers_rollouts(rollout_ids)
        for call in self.calls.values():
            if covered(call.episode):
                call.finished = True  # still delivers, but adds no row
        keys = self._free(covered)
        self._notify()
        return sorted(keys)

    def _free(self, covered: Callable[[EpisodeId], bool]) -> set[str]:
        keys: set[str] = set()
        for table in (self.ledger, self.cuts, self.restored_cuts):
            for episode in [e for e in table if covered(e)]:
                keys.add(episode.capture_key)
                del table[episode]
        for members in (self.restored, self.finishing):
            for episode in [e for e in members if covered(e)]:
                keys.add(episode.capture_key)
                members.discard(episode)
        return keys

    # --- data plane ----------------------------------------------------------
    def admit(
        self,
        episode: EpisodeId,
        digest: str,
        params: str = "",
        *,
        position: int | None = None,
        limit: int | None = None,
    ) -> Call:
        """Admit one call (or refuse it while a checkpoint is open or once its
        attempt is retired).  `params` is the digest of the call's
        generation-defining parameters, `limit` its output-token limit."""
        if not self.gate.is_open:
            raise AdmissionClosed(f"policy model: a checkpoint is in progress ({episode})")
        if self.retired(episode):
            raise StaleAttempt(f"policy model: attempt {episode.capture_key} was retired")
        self._served = True
        self.restored.discard(episode)
        call = Call(
            episode,
            digest,
            self._next_index,
            asyncio.current_task(),
            params=params,
            position=position,
        )
        self._next_index += 1
        continue_restored(call, self.restored_cuts, limit, self.counts)
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

    def delivered(self, call: Call, row: Row) -> None:
        try:
            if not self.recording or call.finished or self.retired(call.episode):
                return  # the attempt is gone (or nothing is recorded): no row
            add_row(self.ledger.setdefault(call.episode, []), call, row)
        finally:
            self.drop(call)

    def drop(self, call: Call) -> None:
        if self.calls.pop(call.index, None) is not None:
            call.delivering = False
            self._notify()

    def finish(self, episode: EpisodeId) -> bool:
        """The caller closed `episode` (done): free it and every earlier attempt.

        While a checkpoint is open the rows stay until resume, so an export of
        a scope that names the episode still holds them.  True if anything of
        the attempt was held."""
        held = episode in self.ledger or episode in self.restored_cuts or episode in self.restored
        covered = retire_scope([episode])
        for call in self.calls.values():
            if covered(call.episode):
                call.finished = True
        if not self.gate.is_open:
            self.finishing.add(episode)
        else:
            self._finish_now(episode)
        self._notify()
        return held

    def _finish_now(self, episode: EpisodeId) -> None:
        rows = self.ledger.get(episode)
        self._free(retire_scope([episode]))
        if rows is not None and self.collect is not None:
            self.collect(episode, rows)
