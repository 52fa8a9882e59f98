"""The policy model's capture ledger rows and their records.

One row per delivered call, per attempt, keyed by the caller's call position
(the `x-ng-model-call` header), so a call the caller re-issues after a
restore replaces the row of its dropped delivery instead of adding one: the
ledger always ends equal to the caller's boundary.  A record's state
(`ModelState`) is an attempt's rows and its cut, if any, and how many tokens
they hold (the restart bias of a restore counts episodes by it).  Kept apart from the
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


class TokenProgress(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How far an episode had got, in the shape `ray_ckpt.control.progress` reads."""

    tokens: int  # generated for the episode: its delivered rows and its cut


class ModelState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One record's state: the attempt's ledger rows and its cut, if any."""

    rows: list[dict[str, Any]]
    cut: Cut | None = None
    # Derived from `rows` and `cut` at export, for the restart bias only (an
    # install ignores it).  Optional: records written before it decode, and
    # None when some row does not say its token count.
    progress: TokenProgress | None = None


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
            state = ModelState(rows=list(rows), cut=cut, progress=tokens_of(rows, cut))
            records.append(Record(episode.capture_key, to_builtins(state)))
    records.sort(key=lambda r: r.key)
    return records


def tokens_of(rows: Sequence[Row], cut: Cut | None) -> TokenProgress | None:
    """The tokens an episode had generated: its delivered calls' and the cut
    in flight; None when a row does not say (a partial sum would understate)."""
    counts = [r.get("tokens") for r in rows]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        return None
    delivered = sum(n for n in counts if isinstance(n, int))
    return TokenProgress(tokens=delivered + (0 if cut is None else len(cut.tokens)))


def parse_state(record: Record) -> ModelState:
    try:
        return msgspec.convert(record.state, ModelState)
    except msgspec.ValidationError as exc:
        raise InvalidCheckpointState(f"model record {record.key!r}: {exc}") from None
