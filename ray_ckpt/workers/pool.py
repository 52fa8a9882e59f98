"""The host side: start N worker processes, talk to them, notice their loss.

Workers are child processes of the host (not Ray actors) because they must
inherit the one listening socket: that is what lets any of them accept on
the server's port, as uvicorn workers do.  Each connects back over a Unix
socket in a private temporary directory (mode 0700) and says hello; the
table (`tracking`) records it.  A worker's loss is noticed three ways: its
connection ends (a kill -9 closes it at once), its process exits, or it is
silent past the table's `silence_s` (hung: it is then killed).  A lost worker
is replaced after `respawn_delay_s`; the replacement starts closed if a
checkpoint is open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ray_ckpt.gym_server.spec import ServerSpec
from ray_ckpt.workers.channel import MESSAGE_TIMEOUT_S, Channel, ChannelClosed
from ray_ckpt.workers.config import WorkerConfig
from ray_ckpt.workers.frames import DEFAULT_MAX_FRAME_BYTES
from ray_ckpt.workers.spawn import spawn_worker, to_report
from ray_ckpt.workers.tracking import WorkerTable, worker_id

log = logging.getLogger(__name__)

RESPAWN_DELAY_S = 0.5
# Exits in a row before a worker ever said hello, after which it is not respawned.
MAX_FAILED_STARTS = 3
STOP_GRACE_S = 10.0


class WorkerPool:
    def __init__(
        self,
        spec: ServerSpec,
        table: WorkerTable,
        shared: socket.socket,
        *,
        control_url: str | None,
        changed: Callable[[], None] = lambda: None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        respawn_delay_s: float = RESPAWN_DELAY_S,
    ) -> None:
        self.spec = spec
        self.table = table
        self.shared = shared
        self.control_url = control_url
        self.changed = changed
        self.max_frame_bytes = max_frame_bytes
        self.respawn_delay_s = respawn_delay_s
        self.marks: dict[str, int] = {}  # the attempt fence, mirrored to new workers
        # Told of every worker incarnation that is gone (lost, or replaced
        # unnoticed), before a replacement's hello reads `marks`.
        self.on_lost: Callable[[str], None] = lambda wid: None
        # The workers' servers hold finished results (completion receipts):
        # what they were built with, said at each hello; never a report.
        self.holds_results = False
        self.channels: dict[str, tuple[int, Channel]] = {}  # id -> (incarnation, channel)
        self.urls: dict[int, str] = {}  # index -> private URL
        self.peers_version = 0  # bumped on every change of `urls`
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self._dir = tempfile.mkdtemp(prefix="rck-w-")
        self.socket_path = os.path.join(self._dir, "host.sock")
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self.spawned = 0
        self._complete = asyncio.Event()  # every expected worker reported once
        self._waiters: list[asyncio.Future[None]] = []
        self._hellos: dict[int, int] = {}  # index -> hellos ever said
        self._failed = asyncio.Event()
        self.failure: str | None = None  # why a worker cannot start at all

    # --- lifecycle -------------------------------------------------------------
    async def start(self, timeout_s: float = 60.0) -> None:
        """Listen, spawn every worker, and wait until each has reported once."""
        self._server = await asyncio.start_unix_server(
            self._connected, path=self.socket_path, limit=2**20
        )
        self._spawn_all()
        self._task(self._watch_silence())
        complete = asyncio.ensure_future(self._complete.wait())
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.wait({complete, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            complete.cancel()
            failed.cancel()
        if self.failure is not None:
            raise RuntimeError(f"{self.spec.actor_name}: {self.failure}")

    def _spawn_all(self) -> None:
        for index in range(self.table.expected):
            self._task(self._run_worker(index))

    def _task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_worker(self, index: int) -> None:
        """Keep worker `index` running (respawned after a loss) until stop."""
        failed_starts = 0
        while not self._stopping:
            config = WorkerConfig(
                spec=self.spec,
                index=index,
                workers=self.table.expected,
                socket_path=self.socket_path,
                listen_fd=self.shared.fileno(),
                control_url=self.control_url,
                max_frame_bytes=self.max_frame_bytes,
            )
            proc = await spawn_worker(config)
            self.spawned += 1
            self.procs[index] = proc
            hellos = self._hellos.get(index, 0)
            code = await proc.wait()
            self._lost(worker_id(index), None)
            if self._stopping:
                return
            if self._hellos.get(index, 0) == hellos:
                failed_starts += 1
                if failed_starts >= MAX_FAILED_STARTS:
                    # A server that cannot start (a bad factory, an ASGI app)
                    # is an error to report, not a process to respawn forever.
                    self.failure = (
                        f"worker w{index} exited {failed_starts} times before it started "
                        f"(last exit code {code}; its error is in the host's log)"
                    )
                    self._failed.set()
                    return
            else:
                failed_starts = 0
            log.warning(
                "%s: worker w%d exited (%s); replacing it", self.spec.actor_name, index, code
            )
            await asyncio.sleep(self.respawn_delay_s)

    # --- connections -------------------------------------------------------------
    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me: dict[str, Any] = {}

        async def handle(op: str, body: dict[str, Any]) -> Any:
            if op != "hello" or me:
                raise ValueError(f"unexpected {op!r} from a worker")
            index = int(body["index"])
            wid = worker_id(index)
            old = self.channels.pop(wid, None)
            if old is not None:
                await old[1].aclose()
            if wid in self.table.members():
                self.on_lost(wid)  # replaced before its loss was noticed
            incarnation = self.table.join(wid, int(body["pid"]))
            self.holds_results = self.holds_results or bool(body.get("holds_results"))
            me.update(wid=wid, incarnation=incarnation)
            self.channels[wid] = (incarnation, channel)
            self.urls[index] = str(body["url"])
            self.peers_version += 1
            self._hellos[index] = self._hellos.get(index, 0) + 1
            self._task(self._broadcast_peers())
            self._changed()
            return {
                "incarnation": incarnation,
                "generation": self.table.generation,
                "closed": self.table.closed,
                "marks": dict(self.marks),
                "urls": {str(k): v for k, v in self.urls.items()},
                "peers_version": self.peers_version,
            }

        def on_message(op: str, body: dict[str, Any]) -> None:
            if (
                op == "report"
                and me
                and self.table.report(me["wid"], me["incarnation"], to_report(body))
            ):
                self._changed()

        channel = Channel(
            reader,
            writer,
            handler=handle,
            on_message=on_message,
            name=f"{self.spec.actor_name}:host",
            max_frame_bytes=self.max_frame_bytes,
        )
        channel.start()
        await channel.closed.wait()
        if me:
            self._lost(me["wid"], me["incarnation"])

    def _changed(self) -> None:
        if len(self.table.current()) >= self.table.expected:
            self._complete.set()
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        self.changed()

    async def wait_change(self) -> None:
        """Until the table next changes (a report, a join, a loss)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter

    def _lost(self, wid: str, incarnation: int | None) -> None:
        if self.table.lose(wid, incarnation):
            if not self._stopping:
                log.warning("%s: worker %s lost", self.spec.actor_name, wid)
                self.on_lost(wid)  # a stopping host fences nothing any more
            entry = self.channels.get(wid)
            if entry is not None and (incarnation is None or entry[0] == incarnation):
                del self.channels[wid]
                self._task(entry[1].aclose())
            if self.urls.pop(int(wid[1:]), None) is not None:
                self.peers_version += 1
            self._task(self._broadcast_peers())
            self._changed()

    async def _broadcast_peers(self) -> None:
        # The table and its version are read together: a worker keeps the
        # newest it has seen, whatever order the hello reply and this arrive in.
        body = {
            "urls": {str(k): v for k, v in self.urls.items()},
            "peers_version": self.peers_version,
        }
        for _, channel in list(self.channels.values()):
            await channel.send("peers", body)

    async def _watch_silence(self) -> None:
        while True:
            await asyncio.sleep(max(self.table.silence_s / 4, 0.05))
            for wid in self.table.expire():
                # Hung, not dead: kill it so it can never serve again.
                proc = self.procs.get(int(wid[1:]))
                if proc is not None and proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGKILL)
                self._lost(wid, None)

    # --- calls -------------------------------------------------------------------
    async def call(
        self, wid: str, op: str, body: dict[str, Any], timeout_s: float = MESSAGE_TIMEOUT_S
    ) -> Any:
        entry = self.channels.get(wid)
        if entry is None:
            raise ChannelClosed(f"{self.spec.actor_name}: worker {wid} is not connected")
        return await entry[1].call(op, body, timeout_s)

    async def call_all(
        self, op: str, body: dict[str, Any], timeout_s: float = MESSAGE_TIMEOUT_S
    ) -> dict[str, Any]:
        """The op on every connected worker; raises the first failure (after all end)."""
        return await each_worker(sorted(self.channels), lambda w: self.call(w, op, body, timeout_s))

    async def tell_all(self, op: str, body: dict[str, Any]) -> None:
        """A generation change: every worker's reply is its report at that generation."""
        wids = sorted(self.channels)

        async def one(wid: str) -> None:
            entry = self.channels.get(wid)
            if entry is None:
                return
            try:
                reply = await entry[1].call(op, body)
            except Exception:
                log.warning("%s: %s to %s failed", self.spec.actor_name, op, wid, exc_info=True)
                return
            if self.table.report(wid, entry[0], to_report(reply)):
                self._changed()

        await asyncio.gather(*(one(w) for w in wids))

    def pids(self) -> dict[str, int]:
        return {w: pid for w, (_, pid) in self.table.members().items()}

    async def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.call_all("stop", {}, 5.0), 5.0)
        procs = [p for p in self.procs.values() if p.returncode is None]
        try:
            async with asyncio.timeout(STOP_GRACE_S):
                await asyncio.gather(*(p.wait() for p in procs))
        except TimeoutError:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        for _, channel in list(self.channels.values()):
            await channel.aclose()
        self.channels.clear()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for p in self.procs.values():
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


async def each_worker(wids: Sequence[str], call: Callable[[str], Awaitable[Any]]) -> dict[str, Any]:
    """`call` on every worker at once; every call ends before the first failure
    is raised, so no reply is left in flight behind the error."""
    results = await asyncio.gather(*(call(w) for w in wids), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return dict(zip(wids, results, strict=True))
