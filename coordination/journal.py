"""The coordinator's durable note of the checkpoint it has open.

Written (temp file, fsync, rename, fsync of the directory) before every
fan-out, so a coordinator that Ray restarts — or a new one over the same
state directory — knows which checkpoint ID was in flight, in which phase,
and who took part.  Recovery then aborts it (resume everywhere; for a
restore, retire what was installed first).  Every participant call is
idempotent, so re-driving a phase that already reached some is harmless.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile

import msgspec

JOURNAL_NAME = "coordinator-state.json"


class JournalEntry(msgspec.Struct, kw_only=True):
    checkpoint_id: str
    # preparing, prepared, committing, committed, resuming; restoring, restored
    phase: str
    op: str  # "checkpoint" or "restore"
    checkpoint_dir: str | None = None
    episode_ids: list[str] = msgspec.field(default_factory=list)  # capture keys (restore)
    # `<kind>/<name>` → how to find it again (transport, actor name or URL; no secrets)
    members: dict[str, dict[str, str]] = msgspec.field(default_factory=dict)
    updated_at: float = 0.0


_decoder = msgspec.json.Decoder(JournalEntry)


class Journal:
    """One small JSON file in `state_dir`; memory only when `state_dir` is None."""

    def __init__(self, state_dir: str | os.PathLike[str] | None = None) -> None:
        self.path = pathlib.Path(state_dir) / JOURNAL_NAME if state_dir is not None else None
        self._memory: JournalEntry | None = None

    def record(self, entry: JournalEntry) -> None:
        self._memory = entry
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = msgspec.json.encode(entry)
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
        try:
            return _decoder.decode(data)
        except msgspec.DecodeError:
            # A torn journal cannot name a checkpoint; participants' leases cover it.
            return None

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
