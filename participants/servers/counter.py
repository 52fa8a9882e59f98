"""A small reference server for multi-worker hosting: per-rollout counters and
a CPU-bound handler.

- `POST /ng-rollout/<key>/step` `{"hold_s": 0}` adds one to the rollout's
  counter (after holding the step open `hold_s` seconds: a step in flight is
  not at a boundary, so it blocks a prepare) and answers `{"count", "pid"}`.
  A restored rollout continues its count under attempt + 1.  Refused with
  `admission_closed` while a checkpoint is open, `stale_attempt` when retired.
- `POST /work` `{"n": 20000}` hashes `n` rounds (pure CPU, no state) and
  answers `{"digest", "pid"}`: the benchmark's handler (`benchmarks/workers.py`).
- `GET /whoami` answers `{"pid"}`.

Its state lives in the worker that serves it, so with several workers it
needs rollout-affine spreading (`spreading="rollout"`); `/work` alone is
stateless.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable, Sequence

from aiohttp import web

from participants.common import ServerBase, episode_of, guarded, json_object
from ray_ckpt.errors import AdmissionClosed, InvalidRequest
from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import Blocker, PrepareReport
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage.records.record import Record

MAX_WORK = 10_000_000
MAX_HOLD_S = 60.0


def cpu_work(n: int) -> str:
    digest = b""
    for _ in range(n):
        digest = hashlib.sha256(digest).digest()
    return digest.hex()


class CounterParticipant:
    def __init__(self, kind: str, export_delay_s: float = 0.0) -> None:
        self.kind = kind
        self.export_delay_s = export_delay_s  # a slow export, for crash-mid-export tests
        self.counts: dict[str, int] = {}  # capture key -> count
        self.in_flight: dict[str, int] = {}  # capture key -> steps under way
        self.admission_open = True
        self.served = False
        self.restored = False
        self._notify: Callable[[], None] = lambda: None

    def bind(self, notify: Callable[[], None]) -> None:
        self._notify = notify

    def close_admission(self) -> None:
        self.admission_open = False

    def open_admission(self) -> None:
        self.admission_open = True

    def ready(self) -> bool:
        return not self.in_flight

    def report(self, limit: int) -> PrepareReport:
        blockers = [Blocker(key=k, state="running") for k in sorted(self.in_flight)]
        return PrepareReport(
            ready=self.ready(),
            blockers=blockers[:limit],
            blocker_count=len(blockers),
            counts={"rollouts": len(self.counts)},
        )

    def live_executions(self) -> int:
        return sum(self.in_flight.values())

    def fresh(self) -> bool:
        return not self.served and not self.restored

    async def export(self, scope: Sequence[EpisodeId] | None) -> list[Record]:
        await asyncio.sleep(self.export_delay_s)
        return [Record(key, {"count": count}) for key, count in sorted(self.counts.items())]

    async def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        for record in records:
            state = record.state
            if not isinstance(state, dict) or not isinstance(state.get("count"), int):
                raise InvalidRequest(f"record {record.key} holds no count")
        nxt = [r.episode_id.next() for r in records]
        for record, episode in zip(records, nxt, strict=True):
            self.counts[episode.capture_key] = record.state["count"]
        self.restored = True
        return nxt

    async def retire(self, episode_ids: Sequence[EpisodeId]) -> list[str]:
        gone = []
        for episode in episode_ids:
            for key in list(self.counts):
                k = EpisodeId.from_capture_key(key)
                if k.rollout_id == episode.rollout_id and k.attempt <= episode.attempt:
                    del self.counts[key]
                    gone.append(key)
        return gone

    async def delete_restored(self, keep: Sequence[EpisodeId]) -> list[str]:
        return []

    async def step(self, key: str, hold_s: float) -> int:
        if not self.admission_open:
            raise AdmissionClosed("a checkpoint is in progress")
        self.served = True
        self.in_flight[key] = self.in_flight.get(key, 0) + 1
        self._notify()
        try:
            await asyncio.sleep(hold_s)
            self.counts[key] = self.counts.get(key, 0) + 1
            return self.counts[key]
        finally:
            self.in_flight[key] -= 1
            if not self.in_flight[key]:
                del self.in_flight[key]
            self._notify()


class CounterServer(ServerBase):
    kind = "resources"

    def __init__(self, name: str, export_delay_s: float = 0.0) -> None:
        super().__init__(name)
        self.participant = CounterParticipant(self.kind, export_delay_s)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/ng-rollout/{key}/step", guarded(self.step))
        app.router.add_post("/work", guarded(self.work))
        app.router.add_get("/whoami", self.whoami)
        return app

    async def step(self, request: web.Request) -> web.Response:
        episode = episode_of(request)
        self.check_attempt(episode)
        body = await json_object(request)
        hold = body.get("hold_s", 0)
        if (
            isinstance(hold, bool)
            or not isinstance(hold, int | float)
            or not 0 <= hold <= MAX_HOLD_S
        ):
            raise InvalidRequest(f"'hold_s' must be a number in [0, {MAX_HOLD_S}]")
        count = await self.participant.step(episode.capture_key, float(hold))
        return web.json_response({"count": count, "pid": os.getpid()})

    async def work(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        n = body.get("n", 20_000)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_WORK:
            raise InvalidRequest(f"'n' must be an integer in [0, {MAX_WORK}]")
        return web.json_response({"digest": cpu_work(n), "pid": os.getpid()})

    async def whoami(self, request: web.Request) -> web.Response:
        return web.json_response({"pid": os.getpid()})


def counter_server(
    *, name: str, settings: CheckpointSettings, export_delay_s: float = 0.0
) -> CounterServer:
    return CounterServer(name, export_delay_s)
