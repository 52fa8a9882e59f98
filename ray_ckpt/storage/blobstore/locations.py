"""Checkpoint locations: parse one into its `Blobs`, probe it before use, name its parent.

A location is an absolute POSIX path, a `file://` URI, or an object-store URI
(`s3://bucket/prefix`, `gs://bucket/prefix`).  Anything else is refused with
`InvalidRequest` naming it: a relative path would land in each actor's own
working directory (so `s3:/bucket/x`, one slash short, is refused too), and an
unknown scheme would be silently misread as a path.

A location's parent and name are plain string operations on an absolute path
or a URI (`split_location`, `join_location`): the same for ``/ckpt/step-1``,
``file:///ckpt/step-1`` and ``s3://bucket/ckpt/step-1``.
"""

from __future__ import annotations

import os
import pathlib
import urllib.parse

from ray_ckpt.errors import CheckpointError, InvalidRequest
from ray_ckpt.storage.blobstore import durable
from ray_ckpt.storage.blobstore.blobs import SCHEMES, Blobs, refuse, temp_key
from ray_ckpt.storage.blobstore.local_blobs import LocalBlobs
from ray_ckpt.storage.blobstore.location_errors import directory_errors


def open_location(location: str | os.PathLike[str]) -> Blobs:
    """The `Blobs` for `location`; `InvalidRequest` if it cannot name one.

    Opening touches nothing: a directory need not exist yet, a bucket is not
    contacted.  `check_location` probes.
    """
    text = os.fspath(location)
    if not isinstance(text, str):
        raise refuse(repr(text), "is not a string")
    if not text:
        raise refuse(text, "is empty")
    if "\0" in text:
        raise refuse(text, "holds a NUL byte")
    if "://" not in text:
        if not text.startswith("/"):
            raise refuse(text, "is a relative path; give an absolute path or a URI")
        return LocalBlobs(pathlib.Path(text), text)
    scheme = text.partition("://")[0].lower()
    if scheme not in SCHEMES:
        raise refuse(text, f"has an unknown scheme {scheme!r} (known: {', '.join(SCHEMES)})")
    if scheme == "file":
        return LocalBlobs(_file_path(text), text)
    return _object_store(text)


def _file_path(text: str) -> pathlib.Path:
    parts = urllib.parse.urlsplit(text)
    if parts.netloc not in ("", "localhost"):
        raise refuse(text, f"names host {parts.netloc!r}; a file:// URI must be local")
    if parts.query or parts.fragment:
        raise refuse(text, "holds a query or fragment")
    path = urllib.parse.unquote(parts.path)
    if not path.startswith("/"):
        raise refuse(text, "has no absolute path")
    return pathlib.Path(path)


def _object_store(text: str) -> Blobs:
    parts = urllib.parse.urlsplit(text)
    if "@" in parts.netloc:
        # Never echo what may be a secret: the message names the bucket only.
        shown = f"{parts.scheme}://***@{parts.netloc.rpartition('@')[2]}{parts.path}"
        raise refuse(shown, "holds credentials; give them through the environment")
    if not parts.netloc:
        raise refuse(text, "names no bucket")
    if parts.query or parts.fragment:
        raise refuse(text, "holds a query or fragment")
    if any(p in (".", "..") for p in parts.path.split("/")):
        raise refuse(text, "holds '.' or '..' in its prefix")
    # Imported here: only object-store locations pay for the client.
    from obstore.store import from_url

    from ray_ckpt.storage.blobstore.object_blobs import ObjectBlobs, store_error

    try:
        store = from_url(text)
    except Exception as exc:
        raise store_error(text, "opened", exc) from exc
    return ObjectBlobs(text, store)


def check_location(location: str | os.PathLike[str], *, for_write: bool) -> Blobs:
    """Open `location` and prove it usable now; the coordinator calls this
    before it pauses anyone, so a typo or an unreachable store costs nothing.

    For a write, the root is created if missing (on disk) and a probe object
    (a temp key, so a crash mid-probe leaves only collectable garbage) is
    created and deleted.  For a read, something must be there: the directory
    (disk) or at least one object under the prefix (store).  Any failure is
    `InvalidRequest` naming the location and the reason: whether it would
    heal or not, nobody should be paused for a checkpoint that cannot land.
    """
    blobs = open_location(location)
    action = "written" if for_write else "read"
    try:
        with directory_errors(blobs.url, action):
            if isinstance(blobs, LocalBlobs):
                _check_local(blobs, for_write=for_write)
            else:
                _check_store(blobs, for_write=for_write)
    except InvalidRequest:
        raise
    except CheckpointError as exc:
        raise InvalidRequest(f"{exc.detail} (checked before the checkpoint)") from exc
    return blobs


def _probe(blobs: Blobs) -> None:
    probe = temp_key("probe")
    if blobs.create(probe, b"") is not None:
        raise refuse(blobs.url, "cannot be written: probe name taken")
    blobs.delete([probe])


def _check_local(blobs: LocalBlobs, *, for_write: bool) -> None:
    if for_write:
        # The root itself is created durably (a participant finding it there
        # would not fsync its parent again); the probe only has to show that
        # a file can be created in it, so it skips the durable write's fsyncs
        # (three of them, on the path of every checkpoint).
        durable.ensure_dir(blobs.root)
        probe = blobs.root / temp_key("probe")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        durable.unlink_quietly(probe)
        return
    if not blobs.root.is_dir():
        raise refuse(blobs.url, "cannot be read: it is not an existing directory")
    os.listdir(blobs.root)


def _check_store(blobs: Blobs, *, for_write: bool) -> None:
    if for_write:
        _probe(blobs)
        return
    if not blobs.list():
        raise refuse(blobs.url, "cannot be read: it holds nothing")


# --- names: a location's parent and a child of it --------------------------


def split_location(location: str) -> tuple[str, str]:
    """(parent location, name) of a checkpoint location: where its `LATEST`
    goes and what it says.  `InvalidRequest` if there is no parent to use."""
    text = location.rstrip("/")
    scheme, sep, rest = text.partition("://")
    base = rest if sep else text
    parent, slash, name = base.rpartition("/")
    if sep and slash and not parent and base.startswith("/"):
        parent = "/"  # file:///name
    if not slash or not name or (sep and not parent):
        raise InvalidRequest(f"checkpoint location {location!r} has no parent to hold LATEST")
    if not sep:
        return parent or "/", name
    return f"{scheme}://{parent}" if parent != "/" else f"{scheme}:///", name


def join_location(root: str, name: str) -> str:
    return f"{root}{name}" if root.endswith("/") else f"{root}/{name}"
