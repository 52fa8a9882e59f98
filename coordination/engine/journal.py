"""The coordinator's durable note of the checkpoint it has open.

Written before every fan-out whose recovery it changes (a checkpoint's
prepare and commit, a restore's steps) and cleared when the checkpoint
closes, so a coordinator that Ray restarts — or a new one over the same
journal — knows which checkpoint ID was in flight, in which phase, and who
took part.  Recovery then aborts it (resume everywhere; for a restore, retire
what was installed first).  Every participant call is idempotent, so
re-driving a phase that already reached some is harmless.  A step after which
recovery would do the same anyway (a checkpoint's "prepared", its resume)
changes the entry in memory only (`PhaseDriver._record(durable=False)`), so
the pause pays no write for nothing.

Where it lives (`coordination.actor.gcs.open_journal`):

- by default in Ray's GCS key-value store (`coordination.actor.gcs.KvJournal`), keyed by the
  coordinator's namespace and name: every node reaches it, so a coordinator
  whose node is lost and that Ray restarts elsewhere (`max_restarts=-1`)
  finds it.  A node-local directory would be empty on the new node, and
  recovery would fall back to the participants' leases;
- in a directory the user names (`state_dir`, e.g. on a shared file
  system): one small JSON file, temp file + fsync + rename + directory fsync;
- in memory only, for the pure core's tests (`Journal(None)`).

Callers write off the event loop (the GCS call and the fsync both block).
This module knows nothing of Ray: the KV store's is `coordination.actor.gcs`.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
from typing import Protocol

import msgspec

from coordination.engine.phases import CoordinatorPhase

JOURNAL_NAME = "coordinator-state.json"


class JournalEntry(msgspec.Struct, kw_only=True):
    checkpoint_id: str
    # Stepped only through the coordinator's phase table (`coordination.engine.phases`).
    phase: CoordinatorPhase
    op: str  # "checkpoint" or "restore"
    checkpoint_dir: str | None = None
    episode_ids: list[str] = msgspec.field(default_factory=list)  # capture keys (restore)
    # `<kind>/<name>` → how to find it again (transport, actor name or URL; no secrets)
    members: dict[str, dict[str, str]] = msgspec.field(default_factory=dict)
    updated_at: float = 0.0


_decoder = msgspec.json.Decoder(JournalEntry)


class JournalStore(Protocol):
    def record(self, entry: JournalEntry) -> None: ...

    def write(self, data: bytes) -> None:
        """Store an encoded entry (`encode`): callers encode on the event loop,
        where the entry is mutated, and write from a thread."""
        ...

    def load(self) -> JournalEntry | None: ...

    def clear(self) -> None: ...


def decode(data: bytes | None) -> JournalEntry | None:
    if data is None:
        return None
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError:
        # A torn journal cannot name a checkpoint; participants' leases cover it.
        return None


def encode(entry: JournalEntry) -> bytes:
    return msgspec.json.encode(entry)


class Journal:
    """One small JSON file in `state_dir`; memory only when `state_dir` is None."""

    def __init__(self, state_dir: str | os.PathLike[str] | None = None) -> None:
        self.path = pathlib.Path(state_dir) / JOURNAL_NAME if state_dir is not None else None
        self._memory: JournalEntry | None = None

    def record(self, entry: JournalEntry) -> None:
        self.write(encode(entry))

    def write(self, data: bytes) -> None:
        self._memory = decode(data)
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".journal.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_dir(self.path.parent)

    def load(self) -> JournalEntry | None:
        if self.path is None:
            return self._memory
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        return decode(data)

    def clear(self) -> None:
        self._memory = None
        if self.path is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
            _fsync_dir(self.path.parent)


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
