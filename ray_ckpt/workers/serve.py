"""Serving a worker's app on the shared port and its private one.

Both kinds: the private port is an ordinary listener; the shared port is
accepted one connection per loop turn (`accept_one_at_a_time`) and each
connection handed to the server's own protocol.  aiohttp apps run as an
`AppRunner`; ASGI apps run in uvicorn in the running loop, behind
`front_asgi`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any, Protocol, cast

from aiohttp import web

from ray_ckpt.workers.front import WorkerFront
from ray_ckpt.workers.front_asgi import asgi_front

log = logging.getLogger(__name__)

# How long a worker's graceful stop lets in-flight requests finish.
WORKER_DRAIN_S = 5.0


class WorkerServing(Protocol):
    async def stop(self) -> None: ...


async def accept_one_at_a_time(
    protocol: Callable[[], asyncio.BaseProtocol], shared: socket.socket
) -> None:
    """Accept on the shared port one connection per loop turn.

    asyncio's own server accepts every pending connection at once (up to its
    backlog) when the socket turns readable, so a worker just back from CPU
    work would take a whole burst while its siblings sit idle.  One accept,
    then the loop runs what is ready (maybe CPU work, during which an idle
    sibling accepts the next): the connections go to the workers with time.
    Changing the socket's backlog instead would shrink the kernel's queue
    for every worker (`listen` is per socket, not per process)."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            conn, _ = await loop.sock_accept(shared)
        except OSError as exc:  # EMFILE and the like: back off, never spin
            log.warning("accept failed: %r", exc)
            await asyncio.sleep(0.1)
            continue
        await loop.connect_accepted_socket(protocol, conn)
        await asyncio.sleep(0)


class _Aiohttp:
    def __init__(self, runner: web.AppRunner, accepting: asyncio.Task[None]) -> None:
        self.runner = runner
        self.accepting = accepting

    async def stop(self) -> None:
        self.accepting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.accepting
        await self.runner.cleanup()


class _Uvicorn:
    def __init__(
        self, server: Any, task: asyncio.Task[None], accepting: asyncio.Task[None]
    ) -> None:
        self.server = server
        self.task = task
        self.accepting = accepting

    async def stop(self) -> None:
        self.accepting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.accepting
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def serve_worker_app(
    app: Any, front: WorkerFront, shared: socket.socket, private: socket.socket
) -> WorkerServing:
    if isinstance(app, web.Application):
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=WORKER_DRAIN_S)
        await runner.setup()
        await web.SockSite(runner, private).start()
        web_server = runner.server
        assert web_server is not None
        accepting = asyncio.get_running_loop().create_task(accept_one_at_a_time(web_server, shared))
        return _Aiohttp(runner, accepting)
    import uvicorn

    config = uvicorn.Config(
        asgi_front(app, front),
        loop="none",
        lifespan="off",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(WORKER_DRAIN_S),
    )
    server = uvicorn.Server(config)
    # uvicorn listens on the private port only: its asyncio server would take
    # every pending connection of the shared port at once (a FastAPI worker
    # grabbed a whole burst of 24 while its sibling stayed idle).
    loop = asyncio.get_running_loop()
    task = loop.create_task(server.serve(sockets=[private]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("uvicorn stopped before it started")
        await asyncio.sleep(0.01)

    def uvicorn_protocol() -> asyncio.BaseProtocol:
        # What uvicorn's own listener builds per connection (`Server.startup`):
        # the connection joins `server_state`, so a graceful stop drains it.
        return cast(
            asyncio.BaseProtocol,
            config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=server.server_state, app_state=server.lifespan.state
            ),
        )

    accepting = loop.create_task(accept_one_at_a_time(uvicorn_protocol, shared))
    return _Uvicorn(server, task, accepting)
