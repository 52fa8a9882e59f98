"""Episode identity: rollout IDs, attempts, capture keys, rollout path prefix.

An episode attempt is keyed by its capture key: ``r`` for the first attempt of
rollout ``r`` and ``r-aN`` after the N-th restore.  Rollout IDs may not end in
``-a<N>`` (N >= 1), so the mapping between keys and (rollout, attempt) is one
to one; ``x-a0`` stays a legal rollout ID because ``-a0`` is never produced.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

from ray_ckpt.errors import InvalidRequest

# `\Z`, not `$`: `$` also matches before a final newline, so "abc\n" would
# pass and name a second key for one episode.  msgspec applies the pattern
# with `re.search`, so the anchors are part of it; Python code uses fullmatch.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z"
_ID_RE = re.compile(ID_PATTERN)
_RESERVED_SUFFIX = re.compile(r"-a([1-9][0-9]*)\Z")
# The checkpoint-ID bound (NeMo Gym's too).
MAX_ID_LENGTH = 128
# NeMo Gym sets no maximum on rollout IDs, and callers derive them from their
# own task IDs, so ours is generous: a bound only so a request stays bounded.
# IDs never become path components (records are stored per participant), so
# no file-name limit applies.
MAX_ROLLOUT_ID_LENGTH = 1024
# A capture key adds at most "-a" and an attempt number.
MAX_CAPTURE_KEY_LENGTH = MAX_ROLLOUT_ID_LENGTH + 24

ROLLOUT_PATH_PREFIX = "ng-rollout"
# The key of a finished, unacknowledged result's record (completion receipts):
# ':' never occurs in a capture key, so the two kinds of record never collide.
RESULT_KEY_PREFIX = "result:"

RolloutIdStr = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_ROLLOUT_ID_LENGTH, pattern=ID_PATTERN)
]


def validate_rollout_id(rollout_id: str) -> str:
    """Return `rollout_id` if it is legal, else raise `InvalidRequest`."""
    # The length first: a huge string is refused without scanning it.
    if isinstance(rollout_id, str) and len(rollout_id) > MAX_ROLLOUT_ID_LENGTH:
        raise InvalidRequest(f"rollout id is longer than {MAX_ROLLOUT_ID_LENGTH} characters")
    if not isinstance(rollout_id, str) or not _ID_RE.fullmatch(rollout_id):
        raise InvalidRequest(f"rollout id {rollout_id!r} must match {ID_PATTERN}")
    if _RESERVED_SUFFIX.search(rollout_id):
        raise InvalidRequest(f"rollout id {rollout_id!r} ends in the reserved attempt suffix -a<N>")
    return rollout_id


class EpisodeId(msgspec.Struct, frozen=True, forbid_unknown_fields=True, order=True):
    """One attempt of one rollout; on the wire ``{"rollout_id", "attempt"}``."""

    rollout_id: str
    attempt: int = 0

    def __post_init__(self) -> None:
        # msgspec runs this on decode too, so a malformed id on the wire is a
        # validation error, never a half-built EpisodeId.
        validate_rollout_id(self.rollout_id)
        if isinstance(self.attempt, bool) or not isinstance(self.attempt, int):
            raise InvalidRequest(f"attempt must be an integer, got {self.attempt!r}")
        if self.attempt < 0:
            raise InvalidRequest(f"attempt must be >= 0, got {self.attempt}")

    @property
    def capture_key(self) -> str:
        if self.attempt == 0:
            return self.rollout_id
        return f"{self.rollout_id}-a{self.attempt}"

    @property
    def rollout(self) -> str:
        return self.rollout_id

    def next(self) -> EpisodeId:
        """The attempt a restore installs this episode's state under."""
        return EpisodeId(self.rollout_id, self.attempt + 1)

    @classmethod
    def from_capture_key(cls, key: str) -> EpisodeId:
        """Parse ``r`` / ``r-aN``; the exact inverse of `capture_key`."""
        if (
            not isinstance(key, str)
            or len(key) > MAX_CAPTURE_KEY_LENGTH
            or not _ID_RE.fullmatch(key)
        ):
            raise InvalidRequest(f"malformed capture key {key!r}")
        match = _RESERVED_SUFFIX.search(key)
        if match is None:
            return cls(key, 0)
        return cls(key[: match.start()], int(match.group(1)))

    def __str__(self) -> str:
        return self.capture_key


def rollout_path(episode: EpisodeId, path: str) -> str:
    """Prefix a downstream call's path so the callee can attribute it."""
    if not path.startswith("/"):
        path = "/" + path
    return f"/{ROLLOUT_PATH_PREFIX}/{episode.capture_key}{path}"


def parse_rollout_path(path: str) -> tuple[EpisodeId | None, str]:
    """Split ``/ng-rollout/<key>/rest`` into (episode, ``/rest``).

    A path without the prefix returns ``(None, path)``; a prefix with a
    malformed key raises `InvalidRequest`.
    """
    head = f"/{ROLLOUT_PATH_PREFIX}/"
    if not path.startswith(head):
        return None, path
    rest = path[len(head) :]
    key, sep, tail = rest.partition("/")
    if not key:
        raise InvalidRequest(f"empty capture key in {path!r}")
    return EpisodeId.from_capture_key(key), "/" + tail if sep else "/"


def result_key(episode: EpisodeId) -> str:
    """The record key of `episode`'s held result (never a capture key)."""
    return RESULT_KEY_PREFIX + episode.capture_key


def is_result_key(key: str) -> bool:
    return key.startswith(RESULT_KEY_PREFIX)


def episode_of_result_key(key: str) -> EpisodeId:
    """The episode a result record belongs to; `InvalidRequest` if malformed."""
    if not is_result_key(key):
        raise InvalidRequest(f"{key!r} is not a result record key")
    return EpisodeId.from_capture_key(key[len(RESULT_KEY_PREFIX) :])


def check_record_key(key: str) -> EpisodeId:
    """A stored record's key: a capture key, or a held result's
    ``result:<capture key>``; the episode it names (`InvalidRequest` if malformed)."""
    if isinstance(key, str) and is_result_key(key):
        return episode_of_result_key(key)
    return EpisodeId.from_capture_key(key)
