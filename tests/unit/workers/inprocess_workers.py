"""A multi-worker server in one process: the real worker side, no subprocesses.

`InProcessPool` stands in for `ray_ckpt.workers.pool.WorkerPool` where a test
or a seeded simulation needs one event loop and no processes: each worker is
the real worker-side object (`ray_ckpt.workers.worker.WorkerRuntime` over a
server built by the spec's factory, exactly as `run_worker` builds it), the
table is the real `WorkerTable`, and the host side is the real
`WorkersParticipant`.  What it replaces is only the transport:

- a call is `WorkerRuntime.handle` run as a task, its body and reply passed
  through the frames' msgpack codec (what the wire keeps and loses), a typed
  error rebuilt from its code as the channel does;
- `kill(wid)` is a `kill -9`: the worker's state is gone, its calls in flight
  fail at once with `ChannelClosed` (their work stops), and the table and the
  participant are told of the loss exactly as the real pool tells them;
- `respawn(wid)` is the replacement joining: a fresh server and runtime,
  whose hello gets the generation, the closed flag and the attempt fence,
  like the real pool's replacement after its respawn delay.  Respawning is
  the caller's step (`kill(wid, respawn=True)` does both at once), so a
  seeded run decides when a replacement shows up;
- reports are pushed on the loop right after each change (`call_soon`, no
  timers), so a run is decided by its seed and the order of its steps.

Build one::

    participant, pool = make_workers_participant("environment", 2)
    engine = ParticipantEngine(participant, instance="env0", settings=SETTINGS,
                                       store=MemoryStore())
    # drive `engine.handle(...)`; a data call of rollout r0 on its owner:
    #   await pool.data(pool.owner("r0"), lambda s: s.run(EpisodeId("r0")))
    # and `pool.kill("w1", respawn=True)` loses a worker at any moment.
    ...
    await pool.stop()

The default server is `EnvLikeServer` (below): an environment participant
(`EnvironmentParticipant` over `EpisodeSteps`, completion receipts when the
settings turn them on) with a one-step `run`, fenced like a real server's
data route.  Any factory (`"module:function"`, as a `ServerSpec` names it)
works if it needs no network to build.

Silence is not simulated by itself: call `expire()` after advancing the
injected clock (the real pool does that on a timer), `heartbeat_all()` to
keep every worker alive.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import msgspec
from aiohttp import web

from participants.environment import EnvironmentParticipant
from ray_ckpt.clock import SYSTEM_CLOCK, Clock
from ray_ckpt.errors import (
    CheckpointError,
    InvalidCheckpointState,
    ParticipantUnavailable,
    error_from_code,
)
from ray_ckpt.gym_server.spec import ServerSpec, load_server
from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import Receipt
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.steps import EpisodeSteps
from ray_ckpt.steps.receipts import ResultReceipts
from ray_ckpt.storage.records.record import Record
from ray_ckpt.workers.aggregate import WorkersParticipant
from ray_ckpt.workers.channel import MESSAGE_TIMEOUT_S, ChannelClosed
from ray_ckpt.workers.config import WorkerConfig
from ray_ckpt.workers.pool import WorkerPool, each_worker
from ray_ckpt.workers.routing import owner_index
from ray_ckpt.workers.spawn import to_report
from ray_ckpt.workers.tracking import WorkerTable, worker_id
from ray_ckpt.workers.worker import WorkerRuntime

log = logging.getLogger(__name__)

TOKEN = "inprocess-workers-token"
ENV_LIKE = "tests.unit.workers.inprocess_workers:env_like_server"
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


T = TypeVar("T")


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


def _wire(value: Any) -> Any:
    """What the other side of a frame gets (the frames' codec)."""
    return _decoder.decode(_encoder.encode(value))


# --- the default server: environment-like, fenced, receipts optional -----------------


@dataclass
class Hold:
    """Keeps a `run` live at its boundary: `reached` once there, until `release`."""

    reached: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)


class GatedEnvironment(EnvironmentParticipant):
    """The environment participant, whose export can be held open (`gate`)
    so a test or a simulation loses its worker mid-export."""

    gate: asyncio.Event | None = None
    exporting: asyncio.Event | None = None

    async def export(self, scope: Sequence[EpisodeId] | None) -> list[Record]:
        if self.exporting is not None:
            self.exporting.set()
        if self.gate is not None:
            await self.gate.wait()
        return await super().export(scope)


class EnvLikeServer:
    """An environment server's participant with a minimal data call: `run`
    advances a rollout's episode by one step (continuing a restored boundary
    if this worker holds one) and, with `finish`, ends it with a result held
    for acknowledgement when receipts are on."""

    kind = "environment"

    def __init__(self, name: str, receipts: ResultReceipts | None) -> None:
        self.name = name
        self.participant = GatedEnvironment(EpisodeSteps(), receipts)
        self.fence: Any = None  # the worker's attempt fence (`attach`)

    def app(self) -> web.Application:
        return web.Application()  # no route: `run` is called directly

    def attach(self, engine: Any) -> None:
        self.fence = engine

    async def aclose(self) -> None:
        return None

    async def run(
        self,
        episode: EpisodeId,
        *,
        steps: int = 1,
        finish: bool = False,
        result: Any = None,
        hold: Hold | None = None,
    ) -> dict[str, Any]:
        """`steps` steps of `episode`: `{"steps": n, "continued": bool, "receipt"?}`,
        `n` counting the steps of the attempts it continues.

        With `hold`, the episode then stays live at its boundary until
        `hold.release` (a rollout in flight: a checkpoint exports it), then
        ends.  `continued` is False when the attempt started from nothing: a
        restored attempt run from scratch is what must never happen silently.
        Refused as a real route refuses: `stale_attempt` by the fence,
        `result_held`, `admission_closed` by the episode table."""
        if self.fence is not None:
            self.fence.retired.check(episode)
        p = self.participant
        p.refuse_finished(episode)
        async with p.steps.begin(episode) as ep:
            restored = ep.claim()
            count = 0 if restored is None else int(restored["steps"])
            for _ in range(steps):
                async with ep.step("replay", name="work") as step:
                    count += 1
                    step.boundary({"steps": count})
            if hold is not None:
                # Held inside a replay step: the episode stands at its last
                # boundary (a continuation runs the step again), so a
                # checkpoint exports it instead of waiting for the handler.
                async with ep.step("replay", name="hold"):
                    hold.reached.set()
                    await hold.release.wait()
        reply: dict[str, Any] = {"steps": count, "continued": restored is not None}
        if finish:
            receipt = p.hold(episode, {"steps": count} if result is None else result)
            if receipt is not None:
                reply["receipt"] = msgspec.to_builtins(receipt)
        return reply


def env_like_server(*, name: str, settings: CheckpointSettings) -> EnvLikeServer:
    receipts = None
    if settings.enabled and settings.completion_receipts:
        receipts = ResultReceipts(
            max_results=settings.max_unacknowledged_results,
            max_bytes=settings.max_unacknowledged_bytes,
        )
    return EnvLikeServer(name, receipts)


# --- the pool ------------------------------------------------------------------------


@dataclass
class _Worker:
    index: int
    incarnation: int
    runtime: WorkerRuntime
    dead: asyncio.Future[None]
    calls: set[asyncio.Task[Any]] = field(default_factory=set)
    report_due: bool = False


class InProcessPool:
    """`WorkerPool`'s interface over in-process workers (see the module doc)."""

    def __init__(self, spec: ServerSpec, table: WorkerTable) -> None:
        self.spec = spec
        self.table = table
        self.changed: Callable[[], None] = lambda: None
        self.marks: dict[str, int] = {}
        self.on_lost: Callable[[str], None] = lambda wid: None
        self.holds_results = False
        self.spawned = 0
        self.killed = 0
        self._workers: dict[str, _Worker] = {}
        self._waiters: list[asyncio.Future[None]] = []
        self._pids = itertools.count(10_000)
        self._closing: set[asyncio.Task[Any]] = set()

    # --- membership ---------------------------------------------------------------
    def start(self) -> None:
        """Every worker joins and reports once (the real pool's start)."""
        for index in range(self.table.expected):
            self.respawn(worker_id(index))

    def respawn(self, wid: str) -> None:
        """A fresh worker `wid` says hello (a replacement if one was there)."""
        index = int(wid[1:])
        if not 0 <= index < self.table.expected:
            raise ValueError(f"no worker {wid} among {self.table.expected}")
        old = self._workers.pop(wid, None)
        if old is not None:
            self._end(old)
        if wid in self.table.members():
            self.on_lost(wid)  # replaced before its loss was noticed, as in the pool
        config = WorkerConfig(
            spec=self.spec,
            index=index,
            workers=self.table.expected,
            socket_path="",  # no socket: calls are direct
            listen_fd=-1,
            control_url=None,
        )
        runtime = WorkerRuntime(config, load_server(self.spec))
        incarnation = self.table.join(wid, next(self._pids))
        self.spawned += 1
        self.holds_results = self.holds_results or runtime.held() is not None
        # The hello's answer, as `run_worker` applies it.
        runtime.incarnation = incarnation
        runtime.fence.load(dict(self.marks))
        if self.table.generation > runtime.generation:
            runtime.generation = self.table.generation
            if self.table.closed:
                runtime.participant.close_admission()
        worker = _Worker(index, incarnation, runtime, asyncio.get_running_loop().create_future())
        runtime.on_dirty = lambda: self._report_soon(worker)
        self._workers[wid] = worker
        self._changed()
        self._report_soon(worker)

    def kill(self, wid: str, *, respawn: bool = False) -> None:
        """`kill -9` of worker `wid`: its state and its calls in flight are gone."""
        worker = self._workers.pop(wid, None)
        if worker is None:
            raise KeyError(f"worker {wid} is not running")
        self.killed += 1
        self._end(worker)
        if self.table.lose(wid, worker.incarnation):
            self.on_lost(wid)
            self._changed()
        if respawn:
            self.respawn(wid)

    def _end(self, worker: _Worker) -> None:
        if not worker.dead.done():
            worker.dead.set_result(None)
        for task in worker.calls:
            task.cancel()  # the process is gone: nothing of it runs on
        task = asyncio.get_running_loop().create_task(worker.runtime.server.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def server(self, wid: str) -> Any:
        """The live server of worker `wid`."""
        return self._workers[wid].runtime.server

    async def data(self, wid: str, call: Callable[[Any], Awaitable[T]]) -> T:
        """A data call on worker `wid`'s server (`call(server)`), ended with
        the worker: a kill stops it and the caller gets `ChannelClosed` (a
        503 or a torn connection over HTTP)."""
        worker = self._workers.get(wid)
        if worker is None:
            raise ChannelClosed(f"{self.spec.actor_name}: worker {wid} is not running")
        task: asyncio.Task[T] = asyncio.get_running_loop().create_task(
            _awaited(call(worker.runtime.server))
        )
        worker.calls.add(task)
        task.add_done_callback(worker.calls.discard)
        await asyncio.wait({task, worker.dead}, return_when=asyncio.FIRST_COMPLETED)
        if task.done() and not task.cancelled():
            return task.result()
        task.cancel()
        raise ChannelClosed(f"{self.spec.actor_name}: worker {wid} died serving a call")

    def runtime(self, wid: str) -> WorkerRuntime:
        return self._workers[wid].runtime

    def owner(self, rollout_id: str) -> str:
        """The worker a rollout routes to (rollout spreading)."""
        return worker_id(owner_index(rollout_id, self.table.expected))

    def pids(self) -> dict[str, int]:
        return {w: pid for w, (_, pid) in self.table.members().items()}

    # --- reports, silence -----------------------------------------------------------
    def _report_soon(self, worker: _Worker) -> None:
        if worker.report_due:
            return
        worker.report_due = True
        asyncio.get_running_loop().call_soon(self._report, worker)

    def _report(self, worker: _Worker) -> None:
        worker.report_due = False
        if self._workers.get(worker_id(worker.index)) is not worker:
            return  # killed since
        report = to_report(_wire(worker.runtime.report()))
        if self.table.report(worker_id(worker.index), worker.incarnation, report):
            self._changed()

    def heartbeat_all(self) -> None:
        for wid, worker in self._workers.items():
            self.table.heartbeat(wid, worker.incarnation)

    def expire(self) -> list[str]:
        """Kill every worker silent past the table's bound (the pool's watch)."""
        silent = self.table.expire()
        for wid in silent:
            worker = self._workers.pop(wid, None)
            if worker is not None:
                self._end(worker)
            self.on_lost(wid)
            self._changed()
        return silent

    def _changed(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        self.changed()

    async def reported(self) -> None:
        """Until every worker has reported at the current generation (or one
        is lost while closed, which no report heals)."""
        while self.table.unreported() and not self.table.summary()["lost"]:
            await self.wait_change()

    async def wait_change(self) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter

    # --- calls (the pool's interface) ----------------------------------------------
    async def call(
        self, wid: str, op: str, body: dict[str, Any], timeout_s: float = MESSAGE_TIMEOUT_S
    ) -> Any:
        worker = self._workers.get(wid)
        if worker is None:
            raise ChannelClosed(f"{self.spec.actor_name}: worker {wid} is not connected")
        task = asyncio.get_running_loop().create_task(worker.runtime.handle(op, _wire(body)))
        worker.calls.add(task)
        task.add_done_callback(worker.calls.discard)
        # Like the channel, the caller's cancellation or timeout ends the
        # call, never the worker's handling of it.
        done, _ = await asyncio.wait(
            {task, worker.dead}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if task in done and not task.cancelled():
            exc = task.exception()
            if exc is None:
                return _wire(task.result())
            if isinstance(exc, CheckpointError):
                raise error_from_code(exc.code, exc.detail)
            raise InvalidCheckpointState(f"{op} failed: {exc!r}")
        if worker.dead.done():
            raise ChannelClosed(f"{self.spec.actor_name}: worker {wid} died during {op}")
        raise ParticipantUnavailable(f"{wid}: no reply to {op} within {timeout_s:g} s")

    async def call_all(
        self, op: str, body: dict[str, Any], timeout_s: float = MESSAGE_TIMEOUT_S
    ) -> dict[str, Any]:
        return await each_worker(
            sorted(self._workers), lambda w: self.call(w, op, body, timeout_s)
        )

    async def tell_all(self, op: str, body: dict[str, Any]) -> None:
        async def one(wid: str) -> None:
            worker = self._workers.get(wid)
            if worker is None:
                return
            try:
                reply = await self.call(wid, op, body)
            except Exception:
                log.warning("%s to %s failed", op, wid, exc_info=True)
                return
            if self.table.report(wid, worker.incarnation, to_report(reply)):
                self._changed()

        await asyncio.gather(*(one(w) for w in sorted(self._workers)))

    async def stop(self) -> None:
        for wid in list(self._workers):
            self._end(self._workers.pop(wid))
        await asyncio.gather(*self._closing, return_exceptions=True)


def make_workers_participant(
    kind: str = "environment",
    n_workers: int = 2,
    *,
    factory: str = ENV_LIKE,
    options: dict[str, Any] | None = None,
    completion_receipts: bool = True,
    settings: dict[str, Any] | None = None,
    clock: Clock = SYSTEM_CLOCK,
    silence_s: float = 10.0,
    stateless: bool = False,
) -> tuple[WorkersParticipant, InProcessPool]:
    """A `WorkersParticipant` over `n_workers` in-process workers, started.

    Call it inside a running event loop.  `settings` is the checkpoint block
    (enabled, with a token, by default; `completion_receipts` sets that key).
    The server is the env-like one unless `factory` names another."""
    block = {
        "enabled": True,
        "control_auth_token": TOKEN,
        "completion_receipts": completion_receipts,
        **(settings or {}),
    }
    spec = ServerSpec(
        kind=kind,
        name="inproc",
        factory=factory,
        options=dict(options or {}),
        settings=block,
        workers=n_workers,
        spreading="rollout",
        stateless=stateless,
    )
    pool = InProcessPool(spec, WorkerTable(n_workers, clock, silence_s=silence_s))
    participant = WorkersParticipant(kind, cast(WorkerPool, pool), stateless=stateless)
    pool.start()
    return participant, pool


def held_of(pool: InProcessPool, wid: str) -> list[Receipt]:
    """The receipts worker `wid` holds right now (its real `ResultReceipts`)."""
    held = pool.runtime(wid).held()
    return [] if held is None else [h.receipt for h in held.collect()]


def episodes(keys: Sequence[str]) -> list[EpisodeId]:
    return [EpisodeId.from_capture_key(k) for k in keys]
