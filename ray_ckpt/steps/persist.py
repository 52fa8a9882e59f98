"""What leaves an episode table: readiness reports and checkpoint records.

A record's state is ``{"boundary": <JSON>, "step": <index of the next step>}``
plus, for an episode with a deadline, ``"spent_s"``: the deadline seconds its
attempts have used so far (parked time excluded).  A restored episode whose
replacement has not moved on is exported again with the state it was restored
from, under the replacement attempt's key.  At most one attempt per rollout is
ever exported, so a committed checkpoint is always restorable.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ray_ckpt.errors import InvalidCheckpointState, InvalidPhase, InvalidRequest, RestartInScope
from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import Blocker, PrepareReport
from ray_ckpt.steps.episode import Episode, Restored
from ray_ckpt.steps.modes import BLOCKING, EpisodeState
from ray_ckpt.storage.records.record import Record, check_json


class EpisodeNotHeld(InvalidPhase):
    """A commit's scope names an episode served during this checkpoint that is gone."""


class RolloutExportedTwice(InvalidPhase):
    """Two attempts of one rollout would be exported: the checkpoint could not restore."""


def build_report(
    live: Iterable[Episode],
    counts: Counter[EpisodeState],
    restored: int,
    limit: int,
    now: float,
) -> PrepareReport:
    eps = list(live)
    blocking = [ep for ep in eps if ep.state in BLOCKING]
    listed = heapq.nsmallest(max(limit, 0), blocking, key=lambda ep: ep.key)
    by_state = {state.value: n for state, n in counts.items() if n}
    if restored:
        by_state["restored"] = restored
    return PrepareReport(
        ready=not blocking,
        blockers=[_blocker(ep, now) for ep in listed],
        blocker_count=len(blocking),
        counts=by_state,
        restarts=sorted(ep.key for ep in eps if ep.restart),
    )


def _blocker(ep: Episode, now: float) -> Blocker:
    step = ep.current
    started = step.started if step is not None and step.started is not None else ep.since
    return Blocker(
        key=ep.key,
        state=ep.state.value,
        step=step.index if step is not None else ep.step_index,
        mode=step.mode.value if step is not None else None,
        running_s=now - started,
        # Between steps after a wait step that recorded no boundary: the
        # checkpoint waits for the handler's next park point.
        detail=step.name
        if step is not None
        else (f"after {ep.unrecorded_wait}" if ep.unrecorded_wait else ""),
    )


def export_records(
    live: Mapping[EpisodeId, Episode],
    restored: Mapping[EpisodeId, Restored],
    scope: Sequence[EpisodeId] | None,
) -> list[Record]:
    eps: list[Episode] = []
    unclaimed: list[tuple[EpisodeId, Restored]] = []
    if scope is None:
        eps = [ep for ep in live.values() if not ep.restart]
        # A live replacement exports its restored entry's boundary itself.
        unclaimed = [(eid, r) for eid, r in restored.items() if eid not in live]
    else:
        for eid in dict.fromkeys(scope):
            ep = live.get(eid)
            if ep is not None:
                if ep.restart:
                    raise RestartInScope(f"episode {eid} restarts; it cannot be continued")
                eps.append(ep)
            elif eid in restored:
                unclaimed.append((eid, restored[eid]))
            # Anything else is served elsewhere: a scope names the whole job.
    _one_attempt_per_rollout([ep.id for ep in eps] + [eid for eid, _ in unclaimed])
    records = []
    for ep in eps:
        if ep.state in BLOCKING:
            raise InvalidPhase(f"episode {ep.key} is not at a boundary ({ep.state.value})")
        boundary = check_json(ep.boundary_state, episode=ep.key)
        state: dict[str, Any] = {"boundary": boundary, "step": ep.step_index}
        if ep.deadline_s is not None:
            # The budget it used so far; the restored attempt continues with
            # what is left (`Episode.remaining`), never a fresh full one.
            state["spent_s"] = min(ep.elapsed(), ep.deadline_s)
        records.append(Record(ep.key, state))
    records.extend(Record(eid.capture_key, r.state) for eid, r in unclaimed)
    records.sort(key=lambda r: r.key)
    return records


def _one_attempt_per_rollout(ids: Iterable[EpisodeId]) -> None:
    seen: dict[str, EpisodeId] = {}
    for eid in ids:
        other = seen.setdefault(eid.rollout_id, eid)
        if other != eid:
            first, second = sorted((other, eid))
            raise RolloutExportedTwice(
                f"rollout {eid.rollout_id}: attempts {first.capture_key} and "
                f"{second.capture_key} are both live here; retire the older one first"
            )


def stage_records(records: Iterable[Record], taken: set[str]) -> dict[EpisodeId, Restored]:
    """Validate every record; return them keyed by attempt + 1 (installs nothing).

    `taken` holds rollouts that already have restored state here.
    """
    staged: dict[EpisodeId, Restored] = {}
    rollouts = set(taken)
    for record in records:
        eid, state = _validate(record)
        if eid.rollout_id in rollouts:
            raise InvalidCheckpointState(f"rollout {eid.rollout_id} is restored twice")
        rollouts.add(eid.rollout_id)
        staged[eid.next()] = Restored(state)
    return staged


def _validate(record: Record) -> tuple[EpisodeId, dict[str, Any]]:
    if not isinstance(record, Record):
        raise InvalidCheckpointState(f"not an episode record: {type(record).__name__}")
    try:
        eid = EpisodeId.from_capture_key(record.key)
    except InvalidRequest as exc:
        raise InvalidCheckpointState(f"record key: {exc.detail}") from None
    state = record.state
    if not isinstance(state, dict) or "boundary" not in state:
        raise InvalidCheckpointState(f"episode {eid}: record state needs a 'boundary'")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidCheckpointState(f"episode {eid}: record 'step' must be an integer >= 0")
    spent = state.get("spent_s", 0.0)
    if (
        isinstance(spent, bool)
        or not isinstance(spent, int | float)
        or not math.isfinite(spent)
        or spent < 0
    ):
        raise InvalidCheckpointState(f"episode {eid}: record 'spent_s' must be a number >= 0")
    check_json(state["boundary"], episode=eid.capture_key)
    return eid, state
