"""Checkpoint records and the opaque `JsonPayload` check.

A record is one exported episode attempt: its capture key and the opaque
state the participant exported for it.  The state is server-owned JSON
(plus `bytes`, which the records format keeps) and is checked once, then
passed through uncopied: a deep validation and copy of large states would
cost more than the rest of a commit.

The check is strict: it admits only what the records format gives back as
the same value and type (None, bool, int, float, str, bytes, list and dict
with str keys).  A tuple comes back a list, a UUID or an Enum member a plain
value, a set not at all, so each is refused with the path of the first one.
orjson cannot be the check: it serialises tuples, UUIDs and Enum members
(IntEnum and StrEnum members even compare equal to what comes back).

Cost, by measurement (this machine, CPython 3.11, 2 shared cores, idle and
under other jobs' load; per state; `tests/unit/storage/test_records_json.py`
bounds the first two):

    state (JSON size)                       check_json   orjson.dumps alone
    text: 150 messages, 341 KB                 0.4-0.7 ms        0.1-0.2 ms
    numbers: 900x20 floats + 624 ints, 347 KB  0.8-3.5 ms        0.6-1.0 ms
    12,000 small dicts, 471 KB                 8-22 ms           1.7-2.1 ms

i.e. 0.01-0.5 ms per 10 KB: the walk goes one nesting level at a time and
checks a level's element types in C (`map(type, ...)` into a set), so its
cost grows with the number of containers, not with the bytes of their leaves.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterator
from enum import Enum
from itertools import chain, compress, repeat
from typing import Any

import msgspec

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.identity import EpisodeId

# Containers nested deeper than this are refused: the records format and the
# participants' copies recurse in Python, and 256 levels stay far inside the
# interpreter's recursion limit even in a worker thread.
MAX_STATE_DEPTH = 256

_SCALARS = frozenset({type(None), bool, int, float, str, bytes})
_ALLOWED = _SCALARS | {list, dict}
_STR = frozenset({str})


class Record(msgspec.Struct, frozen=True, array_like=True):
    """One exported episode attempt (`key` is its capture key).

    `version` is optional: a string the exporter changes whenever the state
    changes (e.g. the episode's boundary sequence number).  An incremental
    checkpoint references an unchanged record by it without encoding the
    state; the exporter vouches that an equal version means an equal state.
    The records file never holds it (only the manifest's frame index does),
    so the records format is unchanged."""

    key: str
    state: Any = None
    version: str | None = None
    # Content-addressed files the state names (a sandbox's, `ray_ckpt.sandbox`):
    # BLAKE3 hex digest -> a local path holding exactly those bytes.  Written
    # once per digest beside the records, never inside the records file;
    # read back as the path of a verified local copy.
    attachments: dict[str, str] | None = None

    @property
    def episode_id(self) -> EpisodeId:
        return EpisodeId.from_capture_key(self.key)


def _is_plain(value: Any) -> bool:
    """True if `value` holds only allowed types within the depth limit.

    One pass per nesting level over all of that level's elements, with the
    type checks in C; `_first_problem` names the culprit when this says no.
    """
    return _plain_walk(value, None)


def plain_size(value: Any) -> int | None:
    """The bytes of `value`'s containers (`sys.getsizeof`) if it holds only
    allowed types within the depth limit, else None (`check_json` says why)."""
    sizes: list[int] = []
    return sum(sizes) if _plain_walk(value, sizes) else None


def _plain_walk(value: Any, sizes: list[int] | None) -> bool:
    t = type(value)
    if t is list:
        lists: list[Any] = [value]
        dicts: list[Any] = []
    elif t is dict:
        lists, dicts = [], [value]
    else:
        return t in _SCALARS
    depth = 0
    while lists or dicts:
        depth += 1
        if depth > MAX_STATE_DEPTH:
            return False
        if sizes is not None:
            sizes.append(sum(map(sys.getsizeof, chain(lists, dicts))))
        if dicts:
            if not set(map(type, chain.from_iterable(dicts))) <= _STR:
                return False
            items = list(
                chain(chain.from_iterable(lists), chain.from_iterable(map(dict.values, dicts)))
            )
        else:
            items = list(chain.from_iterable(lists))
        types = list(map(type, items))
        kinds = set(types)
        if kinds <= _SCALARS:
            return True
        if not kinds <= _ALLOWED:
            return False
        lists = list(compress(items, map(operator.is_, types, repeat(list))))
        dicts = list(compress(items, map(operator.is_, types, repeat(dict))))
    return True


def _segment(key: str) -> str:
    return f".{key}" if key.isidentifier() else f"[{key!r}]"


def _what(value: Any) -> str:
    if isinstance(value, Enum):
        return f"an Enum member ({type(value).__name__}.{value.name})"
    if type(value) is tuple:
        return "a tuple (it would come back a list)"
    name = type(value).__name__
    article = "an" if name[:1] in "aeioAEIO" else "a"
    return f"{article} {name}"


def _children(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if type(value) is list:
        for i, v in enumerate(value):
            yield f"{path}[{i}]", v
    else:
        for k, v in value.items():
            if type(k) is not str:
                raise _Found(f"{path} has a key {k!r} that is {_what(k)}, not a str")
            yield path + _segment(k), v


class _Found(Exception):
    pass


def _first_problem(value: Any) -> str:
    """The first offending element in document order, by path (slow path only)."""
    # Iterative depth-first walk: a state nested past the recursion limit must
    # be refused as data, never crash the check with RecursionError.
    stack: list[Iterator[tuple[str, Any]]] = [iter([("state", value)])]
    try:
        while stack:
            entry = next(stack[-1], None)
            if entry is None:
                stack.pop()
                continue
            path, v = entry
            t = type(v)
            if t in _SCALARS:
                continue
            if t not in _ALLOWED:
                return f"{path} is {_what(v)}"
            if len(stack) > MAX_STATE_DEPTH:
                return f"state nests containers deeper than {MAX_STATE_DEPTH} levels"
            stack.append(_children(v, path))
    except _Found as found:
        return str(found)
    return "state is not JSON data"


def check_json(value: Any, *, episode: str) -> Any:
    """Return `value` unchanged if the records format gives it back the same.

    JSON data plus bytes, integers of any size, NaN and infinities; refused
    (`invalid_checkpoint_state`, naming the path): tuples, sets, UUIDs, Enum
    members, subclasses of the builtins, any other object, non-str dict keys
    and nesting deeper than `MAX_STATE_DEPTH`.
    """
    if _is_plain(value):
        return value
    raise InvalidCheckpointState(f"episode {episode}: {_first_problem(value)}")
