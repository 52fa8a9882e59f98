"""Episode records: what a checkpoint exports and how a restore validates it.

A record's state is ``{"boundary": <JSON>, "step": <index of the next step>}``.
A restored episode whose replacement has not begun is exported again with the
state it was restored from, under the replacement attempt's key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ray_ckpt.errors import InvalidCheckpointState, InvalidPhase, InvalidRequest, RestartInScope
from ray_ckpt.identity import EpisodeId
from ray_ckpt.records import Record, check_json
from ray_ckpt.steps.episode import Episode, Restored
from ray_ckpt.steps.modes import BLOCKING


def export_records(
    live: Mapping[EpisodeId, Episode],
    restored: Mapping[EpisodeId, Restored],
    scope: Sequence[EpisodeId] | None,
) -> list[Record]:
    eps: list[Episode] = []
    unclaimed: list[tuple[EpisodeId, Restored]] = []
    if scope is None:
        eps = [ep for ep in live.values() if not ep.restart]
        unclaimed = list(restored.items())
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
    records = []
    for ep in eps:
        if ep.state in BLOCKING:
            raise InvalidPhase(f"episode {ep.key} is not at a boundary ({ep.state.value})")
        boundary = check_json(ep.boundary_state, episode=ep.key)
        records.append(Record(ep.key, {"boundary": boundary, "step": ep.step_index}))
    records.extend(Record(eid.capture_key, r.state) for eid, r in unclaimed)
    records.sort(key=lambda r: r.key)
    return records


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
    check_json(state["boundary"], episode=eid.capture_key)
    return eid, state
