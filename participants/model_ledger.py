"""The policy model's capture ledger rows and their records.

One row per delivered call, per attempt, keyed by the caller's call position
(the `x-ng-model-call` header), so a call the caller re-issues after a
restore replaces the row of its dropped delivery instead of adding one: the
ledger always ends equal to the caller's boundary.  A record's state
(`ModelState`) is an attempt's rows and its cut, if any.  Kept apart from the
participant (`participants.policy_model`), which owns the tables and decides
when a row is added or freed, because these are the pure parts: how a row
lands and what a record holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from participants.model_calls import Call, Cut
from ray_ckpt.control.wire import to_builtins
from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.records.record import Record

Row = dict[str, Any]


class ModelState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One record's state: the attempt's ledger rows and its cut, if any."""

    rows: list[dict[str, Any]]
    cut: Cut | None = None


def add_row(rows: list[Row], call: Call, row: Row) -> None:
    """Append a delivered call's row at the call's position."""
    if call.position is not None:
        # A re-issued call replaces the row of its dropped delivery
        # (and any row after it: the caller's state is before them).
        rows[:] = [r for r in rows if _position(r) < call.position]
        row = {**row, "position": call.position}
    rows.append(row)


def _position(row: Row) -> int:
    value = row.get("position")
    # A row without one (no header) predates every positioned call.
    return value if isinstance(value, int) else -1


def export_records(
    scope: Sequence[EpisodeId],
    ledger: Mapping[EpisodeId, list[Row]],
    cut_of: Mapping[EpisodeId, Cut],
    restored_cuts: Mapping[EpisodeId, Cut],
    restored: set[EpisodeId],
) -> list[Record]:
    """One record per attempt in scope that holds rows, a cut, or a restore."""
    records = []
    for episode in dict.fromkeys(scope):
        rows = ledger.get(episode, [])
        cut = cut_of.get(episode) or restored_cuts.get(episode)
        if rows or cut is not None or episode in restored:
            state = ModelState(rows=list(rows), cut=cut)
            records.append(Record(episode.capture_key, to_builtins(state)))
    records.sort(key=lambda r: r.key)
    return records


def parse_state(record: Record) -> ModelState:
    try:
        return msgspec.convert(record.state, ModelState)
    except msgspec.ValidationError as exc:
        raise InvalidCheckpointState(f"model record {record.key!r}: {exc}") from None
