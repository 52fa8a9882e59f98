"""How far each exported episode had got, for the restart bias of a restore.

A commit reply carries `progress`: `{capture key: {"steps": n, "tokens": m}}`
for the exported episodes whose record says, and the coordinator saves it
with the checkpoint's timeline (`ray_ckpt.storage.root.history`), so a
restore can count its continued, restarted and lost episodes by how far
each had got.  A record says in one of two ways: the steps framework's
state (`ray_ckpt.steps.persist`: `{"boundary", "step"}`, `step` being the
index of the next step, i.e. the steps done), or any participant's state
carrying `"progress": {"steps": n, "tokens": m}` itself.  Anything else is
unknown, and left out (the field is optional on the wire: a coordinator
reading an older participant's reply finds none).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ray_ckpt.identity import is_result_key
from ray_ckpt.storage.records.record import Record


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def record_progress(state: Any) -> dict[str, int] | None:
    """`{"steps", "tokens"}` as far as `state` says; None if it says nothing."""
    if not isinstance(state, Mapping):
        return None
    own = state.get("progress")
    said = own if isinstance(own, Mapping) else {"steps": state.get("step")}
    found = {k: n for k in ("steps", "tokens") if (n := _count(said.get(k))) is not None}
    return found or None


def progress_of(records: Iterable[Record]) -> dict[str, dict[str, int]]:
    """The progress of every exported episode whose record says (held
    results are finished, not episodes: left out)."""
    out = {}
    for r in records:
        if is_result_key(r.key):
            continue
        p = record_progress(r.state)
        if p is not None:
            out[r.key] = p
    return out
