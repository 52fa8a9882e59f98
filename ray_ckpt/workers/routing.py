"""Which worker owns a rollout, and how a server spreads its requests (pure).

Two ways to spread, chosen per server (`ServerSpec.spreading`, whose values
`ray_ckpt.gym_server.spec` defines):

- `SHARED`: any worker takes any request (the kernel spreads connections over
  the workers accepting on the one port).  For servers whose per-episode state
  lives outside the worker or is per request.
- `ROLLOUT`: a request under ``/ng-rollout/<key>/`` (or a JSON body naming
  ``episode_id.rollout_id``, as an environment's ``/run`` does) is served by
  the worker that owns the rollout; the worker that accepted it forwards it.

The owner is a stable hash of the rollout ID (never Python's salted `hash`),
so it is the same in every process and across a restart with the same worker
count; every attempt of one rollout (``r``, ``r-a1``...) has one owner.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from ray_ckpt.errors import InvalidRequest
from ray_ckpt.identity import ROLLOUT_PATH_PREFIX, EpisodeId

# A body larger than this is never read to find its rollout (it is served
# where it landed, or refused if the path names no rollout).
MAX_PEEK_BYTES = 1024 * 1024

_HEAD = f"/{ROLLOUT_PATH_PREFIX}/"


def owner_index(rollout_id: str, workers: int) -> int:
    """The index (0..workers-1) of the worker that owns `rollout_id`."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    digest = hashlib.blake2b(rollout_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % workers


def rollout_of_path(path: str) -> str | None:
    """The rollout named by a ``/ng-rollout/<key>/`` path, else None.

    A malformed key raises `InvalidRequest` (the caller answers 400)."""
    if not path.startswith(_HEAD):
        return None
    key = path[len(_HEAD) :].partition("/")[0]
    return EpisodeId.from_capture_key(key).rollout_id


def rollout_of_body(raw: bytes) -> str | None:
    """The rollout a JSON body names as ``{"episode_id": {"rollout_id": ...}}``.

    Anything else (not JSON, no such field, a bad ID) is None: the request is
    served where it landed and its own handler judges the body."""
    if not raw or len(raw) > MAX_PEEK_BYTES:
        return None
    try:
        body: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    episode = body.get("episode_id") if isinstance(body, dict) else None
    rollout = episode.get("rollout_id") if isinstance(episode, dict) else None
    if not isinstance(rollout, str):
        return None
    try:
        return EpisodeId(rollout).rollout_id
    except InvalidRequest:
        return None
