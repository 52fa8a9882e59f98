"""Typed errors for a checkpoint directory the participant cannot use.

A commit or restore names its directory in the request, so a directory that
cannot be written or read (no permission, a path through a regular file, a
read-only or pseudo file system, a name too long, a NUL byte) is the caller's
bad request: 400 `invalid_request` naming the directory and the reason, never
a 500 from a raw `OSError`.  It is the code the coordinator uses for an
unreachable location too, and it is not retryable: the same directory fails
the same way until someone changes it; the checkpoint stays open, so the
caller can resume and checkpoint elsewhere.

Other I/O failures (disk full, EIO, quota) are the storage's trouble, not the
request's: 503 `participant_unavailable`, retryable (a retried commit writes
again from a new temp file).

An object store makes the same split in `object_blobs.store_error`: a missing
bucket, refused credentials or a bad path are 400 `invalid_request`; an
unreachable endpoint or a 5xx after the client's retries is 503.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

from ray_ckpt.errors import CheckpointError, InvalidRequest, ParticipantUnavailable

# errnos that say "this location cannot be used", whatever is in it.
_UNUSABLE = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ENAMETOOLONG,
        errno.ELOOP,
        errno.EEXIST,
        errno.ENOENT,
        errno.EINVAL,
        errno.EXDEV,
        errno.ENXIO,
        errno.ENODEV,
        errno.EOPNOTSUPP,
    }
)


def check_dir_name(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Refuse a name no OS call can take (the OS would raise ValueError)."""
    if "\0" in os.fspath(checkpoint_dir):
        raise InvalidRequest(f"checkpoint directory {os.fspath(checkpoint_dir)!r} holds a NUL byte")


def location_error(
    checkpoint_dir: str | os.PathLike[str], action: str, exc: OSError
) -> CheckpointError:
    """The typed error for `exc`, raised while `action` ("written"/"read") the directory."""
    reason = exc.strerror or type(exc).__name__
    where = f" ({exc.filename})" if exc.filename is not None else ""
    detail = (
        f"checkpoint directory {os.fspath(checkpoint_dir)!r} cannot be {action}: {reason}{where}"
    )
    if exc.errno in _UNUSABLE:
        return InvalidRequest(detail)
    return ParticipantUnavailable(detail)


@contextlib.contextmanager
def directory_errors(checkpoint_dir: str | os.PathLike[str], action: str) -> Iterator[None]:
    """Map the OS errors of a store call on `checkpoint_dir` to typed errors."""
    check_dir_name(checkpoint_dir)
    try:
        yield
    except CheckpointError:
        raise
    except OSError as exc:
        raise location_error(checkpoint_dir, action, exc) from exc
