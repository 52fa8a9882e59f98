"""A worker process: one copy of the Gym server, serving the shared port and
obeying its host.

Started by `pool` as ``python -m ray_ckpt.workers.worker`` with its
`WorkerConfig` on stdin and the shared listening socket inherited.  Before
serving a byte it connects to the host and says hello; the host's answer
tells it the current close generation, so a worker that starts while a
checkpoint is open starts closed.  It reports (readiness, blockers, live
executions) whenever its participant's readiness may have changed and at
least every heartbeat, tagged with the generation it obeys.  The host's
requests run the participant's hooks here (`export`, `install`, `retire`, ...).
If the host goes away, the worker stops itself: it never serves unmanaged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Callable
from typing import Any, cast

import msgspec
from aiohttp import web

from ray_ckpt.gym_server.serving import bind_socket, socket_address
from ray_ckpt.gym_server.spec import GymServer, load_server
from ray_ckpt.identity import EpisodeId, episode_of_result_key, is_result_key
from ray_ckpt.reports import MAX_REPORTED_BLOCKERS
from ray_ckpt.steps.receipts import ResultReceipts
from ray_ckpt.steps.retire_marks import RetiredAttempts
from ray_ckpt.storage.records.record import Record
from ray_ckpt.workers.channel import Channel
from ray_ckpt.workers.config import WorkerConfig, decode_config
from ray_ckpt.workers.front import WorkerFront
from ray_ckpt.workers.receipts import answer_receipts
from ray_ckpt.workers.serve import serve_worker_app

log = logging.getLogger(__name__)

REPORT_MIN_INTERVAL_S = 0.01


class WorkerFence:
    """What a server's `attach` gets in a worker: the attempt fence, mirrored
    from the host (marks arrive with retire, install, forget and at hello)."""

    def __init__(self) -> None:
        self.retired = RetiredAttempts()

    def load(self, marks: dict[str, int]) -> None:
        for rollout, attempt in marks.items():
            self.retired.mark(EpisodeId(rollout, attempt))


def _episodes(raw: Any) -> list[EpisodeId]:
    return msgspec.convert(raw, list[EpisodeId])


class WorkerRuntime:
    def __init__(self, config: WorkerConfig, server: GymServer) -> None:
        self.config = config
        self.server = server
        self.participant = server.participant
        self.fence = WorkerFence()
        self.generation = 0
        self.incarnation = 0
        self.channel: Channel | None = None
        self._dirty = asyncio.Event()
        # Told too whenever a report is due (an in-process pool reports at once).
        self.on_dirty: Callable[[], None] = lambda: None
        self.stop_requested = asyncio.Event()
        # An install and the undo of a failed one never interleave: the undo,
        # sent after the install, waits for it to end on this worker.
        self._installing = asyncio.Lock()
        if config.spec.checkpoint_settings().enabled:
            server.attach(cast(Any, self.fence))
        self.participant.bind(self.dirty)

    def dirty(self) -> None:
        """The participant's readiness or counts may have changed: report."""
        self._dirty.set()
        self.on_dirty()

    # --- reports -----------------------------------------------------------
    def held(self) -> ResultReceipts | None:
        """The finished results this worker holds (completion receipts on)."""
        hook = getattr(self.participant, "receipts", None)
        return hook if isinstance(hook, ResultReceipts) else None

    def report(self) -> dict[str, Any]:
        rep = self.participant.report(MAX_REPORTED_BLOCKERS)
        retiring = getattr(self.participant, "retiring", None)
        held = self.held()
        return {
            "held": -1 if held is None else len(held),
            "held_bytes": 0 if held is None else held.bytes,
            "incarnation": self.incarnation,
            "generation": self.generation,
            "ready": self.participant.ready(),
            "live": self.participant.live_executions(),
            "fresh": self.participant.fresh(),
            "retiring": int(retiring()) if retiring is not None else 0,
            "blockers": msgspec.to_builtins(rep.blockers),
            "blocker_count": max(rep.blocker_count, len(rep.blockers)),
            "restarts": list(rep.restarts),
        }

    async def report_loop(self) -> None:
        assert self.channel is not None
        while not self.channel.closed.is_set():
            self._dirty.clear()
            await self.channel.send("report", self.report())
            # Coalesce a burst of changes (a notify per generated token) into
            # one report; a prepare waits this much longer at most.
            await asyncio.sleep(REPORT_MIN_INTERVAL_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.heartbeat_s):
                    await self._dirty.wait()

    # --- the host's requests ---------------------------------------------------
    async def handle(self, op: str, body: dict[str, Any]) -> Any:
        p = self.participant
        if op in ("close", "open"):
            generation = int(body["generation"])
            if generation < self.generation:
                return self.report()  # overtaken by a newer close or open: ignore it
            (p.close_admission if op == "close" else p.open_admission)()
            self.generation = generation
            self.dirty()
            return self.report()
        if op == "export":
            scope = None if body.get("scope") is None else _episodes(body["scope"])
            return {"records": await p.export(scope)}
        if op == "install":
            records = msgspec.convert(body["records"], list[Record])
            async with self._installing:
                installed = await p.install(records)
            for record in records:
                if not is_result_key(record.key):  # a held result is no attempt
                    self.fence.retired.mark(record.episode_id)
            return {"installed": installed}
        if op == "uninstall":
            return {"keys": await self._uninstall(list(body["keys"]))}
        if op == "mark":
            # Restored attempts another worker held and lost: refused here too.
            for episode in _episodes(body["episodes"]):
                self.fence.retired.mark(episode)
            return {}
        if op == "retire":
            episodes = _episodes(body["episodes"])
            for episode in episodes:
                self.fence.retired.mark(episode)
            return {"keys": await p.retire(episodes)}
        if op == "delete_restored":
            return {"keys": await p.delete_restored(_episodes(body["keep"]))}
        if op == "forget":
            self.fence.retired.forget(body["rollouts"])
            hook = getattr(p, "forget", None)
            if hook is not None:
                hook(list(body["rollouts"]))
            return {}
        if op == "park":
            hook = getattr(p, "park_exported", None)
            if hook is not None:
                await hook(msgspec.convert(body["records"], list[Record]))
            return {}
        if op in ("receipts_known", "receipts_ack", "receipts_collect"):
            return self._receipts(op, body)
        if op == "stop":
            self.stop_requested.set()
            return {}
        raise ValueError(f"unknown worker operation {op!r}")

    async def _uninstall(self, keys: list[str]) -> list[str]:
        """Undo this worker's part of an install the server's restore failed
        elsewhere: its restored episodes and the held results it installed
        (the participant's `delete_restored` frees episodes, never results)."""
        async with self._installing:
            freed = await self.participant.delete_restored(())
            held = self.held()
            if held is not None:
                results = [episode_of_result_key(k) for k in keys if is_result_key(k)]
                # A restore runs in a fresh worker: every result of these
                # rollouts it holds came with this install.
                freed += held.drop_retired(results)
        self.dirty()
        return sorted(freed)

    def _receipts(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = answer_receipts(self.held(), op, body)
        if op == "receipts_ack":
            self.dirty()  # readiness may change (the bound), and the counts did
        return reply


async def run_worker(config: WorkerConfig) -> None:
    server = load_server(config.spec)
    app = server.app()
    runtime = WorkerRuntime(config, server)
    front = WorkerFront(
        index=config.index,
        workers=config.workers,
        spreading=config.spec.spreading,
        control_url=config.control_url,
    )
    if isinstance(app, web.Application):
        app.middlewares.insert(0, front.middleware)

    def on_message(op: str, body: dict[str, Any]) -> None:
        if op == "peers":
            front.set_peers(
                int(body["peers_version"]), {int(k): str(v) for k, v in body["urls"].items()}
            )

    shared = socket.socket(fileno=config.listen_fd)
    private = bind_socket("127.0.0.1", 0)
    host, port = socket_address(private)
    reader, writer = await asyncio.open_unix_connection(config.socket_path, limit=2**20)
    channel = Channel(
        reader,
        writer,
        handler=runtime.handle,
        on_message=on_message,
        name=f"{config.spec.actor_name}/w{config.index}->host",
        max_frame_bytes=config.max_frame_bytes,
    )
    runtime.channel = channel
    channel.start()
    hello = await channel.call(
        "hello",
        {
            "index": config.index,
            "pid": os.getpid(),
            "url": f"http://{host}:{port}",
            "holds_results": runtime.held() is not None,
        },
    )
    runtime.incarnation = int(hello["incarnation"])
    runtime.fence.load(hello["marks"])
    on_message("peers", hello)
    # A close sent right after the hello may have been obeyed already: only
    # a newer generation than the one obeyed applies.
    if int(hello["generation"]) > runtime.generation:
        runtime.generation = int(hello["generation"])
        if hello["closed"]:
            # Started while a checkpoint is open: closed before serving anything.
            runtime.participant.close_admission()
    serving = await serve_worker_app(app, front, shared, private)
    reports = asyncio.get_running_loop().create_task(runtime.report_loop())
    stopped = asyncio.get_running_loop().create_task(runtime.stop_requested.wait())
    lost = asyncio.get_running_loop().create_task(channel.closed.wait())
    await asyncio.wait({stopped, lost}, return_when=asyncio.FIRST_COMPLETED)
    if lost.done() and not stopped.done():
        # The host is gone: nobody owns this worker's control plane any more.
        log.warning("w%d: host connection lost; stopping", config.index)
        os._exit(3)
    for task in (reports, stopped, lost):
        task.cancel()
    await serving.stop()
    await front.aclose()
    await server.aclose()
    await channel.aclose()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    config = decode_config(sys.stdin.buffer.read())
    asyncio.run(run_worker(config))


if __name__ == "__main__":
    main()
