"""Checkpoint records and the opaque `JsonPayload` check.

A record is one exported episode attempt: its capture key and the opaque
state the participant exported for it.  The state is server-owned JSON
(plus `bytes`, which the records format keeps) and is checked once for
JSON-ness, then passed through uncopied: a deep validation and copy of large
states would cost more than the rest of a commit.
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.identity import EpisodeId

# Types orjson would happily serialise but that are not JSON: refuse them.
_ORJSON_STRICT = (
    orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_SUBCLASS
)


class Record(msgspec.Struct, frozen=True, array_like=True):
    """One exported episode attempt (`key` is its capture key)."""

    key: str
    state: Any = None

    @property
    def episode_id(self) -> EpisodeId:
        return EpisodeId.from_capture_key(self.key)


def _walk_is_json(value: Any, depth: int = 0) -> bool:
    if depth > 10_000:
        return False
    if value is None or isinstance(value, (bool, str, bytes)):
        return True
    if type(value) in (int, float):
        return True
    if type(value) in (list, tuple):
        return all(_walk_is_json(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _walk_is_json(v, depth + 1) for k, v in value.items())
    return False


def check_json(value: Any, *, episode: str) -> Any:
    """Return `value` unchanged if it is JSON data (NaN/inf and bytes allowed).

    The fast path is one orjson pass; values orjson refuses but that are still
    data (integers beyond 64 bits, bytes) fall back to a Python walk.
    """
    try:
        orjson.dumps(value, option=_ORJSON_STRICT)
        return value
    except TypeError:
        pass
    if _walk_is_json(value):
        return value
    raise InvalidCheckpointState(
        f"episode {episode}: exported state is not JSON data ({type(value).__name__})"
    )
