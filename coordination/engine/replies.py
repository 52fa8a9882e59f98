"""Reading participants' replies tolerantly.

A participant may run our control plane (old or new) or NeMo Gym's, so a
`report` can carry `blockers` as capture-key strings (NeMo Gym's shape and
ours now), as objects `{key, state, step, ...}` (our participants before
`blocker_details`), `blocker_details` beside string `blockers`, fields we do
not know, or none of them.  Everything here reads what is there and ignores
what is not: never an `AttributeError` or `KeyError` on a reply's shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_REPORTED_BLOCKERS = 100


def as_mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def report_of(reply: Any) -> Mapping[str, Any]:
    """A reply's `report`, or `{}` if it has none (or not a mapping)."""
    return as_mapping(as_mapping(reply).get("report"))


def _key_of(item: Any) -> str | None:
    if isinstance(item, str):
        return item
    if isinstance(item, Mapping):
        key = item.get("key")
        return key if isinstance(key, str) else None
    return None


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else []


def blocker_details(report: Any) -> list[dict[str, Any]]:
    """Per-blocker objects: `blocker_details` when present, else object-shaped
    `blockers` (older participants), else `{"key": k}` for each string."""
    r = as_mapping(report)
    details = [dict(d) for d in _list(r.get("blocker_details")) if _key_of(d) is not None]
    if details:
        return details[:MAX_REPORTED_BLOCKERS]
    out: list[dict[str, Any]] = []
    for item in _list(r.get("blockers")):
        key = _key_of(item)
        if key is None:
            continue
        out.append(dict(item) if isinstance(item, Mapping) else {"key": key})
    return out[:MAX_REPORTED_BLOCKERS]


def blocker_keys(report: Any) -> list[str]:
    """The capture keys of the blockers, whatever their shape."""
    r = as_mapping(report)
    keys = [k for k in (_key_of(b) for b in _list(r.get("blockers"))) if k is not None]
    if not keys:
        keys = [d["key"] for d in blocker_details(r)]
    return keys[:MAX_REPORTED_BLOCKERS]


def blocker_count(report: Any) -> int:
    """The full count when the participant says it, else how many it listed."""
    r = as_mapping(report)
    count = r.get("blocker_count")
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        return count
    return len(blocker_keys(r))


def string_list(value: Any) -> list[str]:
    """A list of strings from a reply field (anything else dropped)."""
    return [v for v in _list(value) if isinstance(v, str)]


def int_or_none(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def float_or_none(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None
