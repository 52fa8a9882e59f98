"""Fakes for unit tests of the pure engine logic (no Ray, no files)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import Blocker, PrepareReport
from ray_ckpt.storage.records.record import Record


class FakeParticipant:
    """Episodes are capture keys mapped to (at_boundary, state)."""

    def __init__(self, kind: str = "environment") -> None:
        self.kind = kind
        self.admission_open = True
        self.live: dict[str, tuple[bool, Any]] = {}
        self.restored: dict[str, Any] = {}
        self.served = False
        self.fail_close = False
        self.retire_gate: asyncio.Event | None = None
        self.retired_keys: list[str] = []
        self.deleted: list[str] = []
        self.restarts: set[str] = set()
        self._notify: Callable[[], None] = lambda: None

    # test helpers
    def start(self, key: str, *, at_boundary: bool = False, state: Any = None) -> None:
        self.served = True
        self.live[key] = (at_boundary, state)
        self._notify()

    def reach_boundary(self, key: str, state: Any = None) -> None:
        self.live[key] = (True, state)
        self._notify()

    # Participant protocol
    def bind(self, notify: Callable[[], None]) -> None:
        self._notify = notify

    def close_admission(self) -> None:
        if self.fail_close:
            raise RuntimeError("close failed")
        self.admission_open = False

    def open_admission(self) -> None:
        self.admission_open = True

    def ready(self) -> bool:
        return all(b for k, (b, _) in self.live.items() if k not in self.restarts)

    def report(self, limit: int) -> PrepareReport:
        blockers = [
            Blocker(key=k, state="running")
            for k, (b, _) in sorted(self.live.items())
            if not b and k not in self.restarts
        ]
        return PrepareReport(
            ready=not blockers,
            blockers=blockers[:limit],
            blocker_count=len(blockers),
            counts={"live": len(self.live)},
            restarts=sorted(self.restarts),
        )

    def live_executions(self) -> int:
        return len(self.live)

    def fresh(self) -> bool:
        return not self.served and not self.restored

    async def export(self, scope: Sequence[EpisodeId] | None) -> list[Record]:
        keys = sorted(set(self.live) - self.restarts) + sorted(self.restored)
        return [Record(k, self.live[k][1] if k in self.live else self.restored[k]) for k in keys]

    async def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        nxt = [r.episode_id.next() for r in records]
        for r, n in zip(records, nxt, strict=True):
            self.restored[n.capture_key] = r.state
        return nxt

    async def retire(self, episode_ids: Sequence[EpisodeId]) -> list[str]:
        if self.retire_gate is not None:
            await self.retire_gate.wait()
        out = []
        for e in episode_ids:
            for table in (self.live, self.restored):
                for key in list(table):
                    k = EpisodeId.from_capture_key(key)
                    if k.rollout_id == e.rollout_id and k.attempt <= e.attempt:
                        del table[key]
                        out.append(key)
        self.retired_keys += out
        self._notify()
        return out

    async def delete_restored(self, keep: Sequence[EpisodeId]) -> list[str]:
        wanted = {e.capture_key for e in keep}
        gone = [k for k in self.restored if k not in wanted]
        for k in gone:
            del self.restored[k]
        self.deleted += gone
        return gone


class _Stop:
    def __init__(self) -> None:
        self.stopped = False
        self.lock = threading.Lock()

    def stop(self) -> None:
        with self.lock:
            self.stopped = True


class Manifest(msgspec.Struct, frozen=True):
    checkpoint_id: str
    kind: str
    instance: str
    record_count: int


class MemoryStore:
    def __init__(self) -> None:
        self.data: dict[tuple[str, str, str], tuple[Manifest, list[Record]]] = {}
        self.writes = 0
        self.write_gate: threading.Event | None = None

    def new_stop(self) -> _Stop:
        return _Stop()

    def write(
        self,
        checkpoint_dir: str,
        *,
        kind: str,
        instance: str,
        checkpoint_id: str,
        records: Sequence[Record],
        stop: Any,
    ) -> Manifest:
        self.writes += 1
        if self.write_gate is not None:
            self.write_gate.wait(10)
        with stop.lock:
            if stop.stopped:
                raise InvalidCheckpointState("write stopped")
            manifest = Manifest(checkpoint_id, kind, instance, len(records))
            self.data[(checkpoint_dir, kind, instance)] = (manifest, list(records))
        return manifest

    def read(
        self,
        checkpoint_dir: str,
        *,
        kind: str,
        instance: str,
        select: Callable[[str], bool],
        attachments_dir: str | None = None,  # records keep their paths as written
    ) -> tuple[Manifest, list[Record]]:
        try:
            manifest, records = self.data[(checkpoint_dir, kind, instance)]
        except KeyError:
            raise InvalidCheckpointState("missing manifest") from None
        return manifest, [r for r in records if select(r.key)]
