"""Serving a Gym app in the running event loop, on a socket bound up front.

`serve_app` runs an aiohttp app (`AppRunner` + `SockSite`) or an ASGI app
(uvicorn's `Server` as a task on the running loop, no extra process) on a
socket bound synchronously, so a port-in-use error surfaces where the caller
binds, and port 0 is resolved before anything is served.  Hosted ASGI apps
get no lifespan events (a failed lifespan startup makes uvicorn exit the
process): a server sets up in its factory and tears down in `aclose`.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Protocol

from aiohttp import web

from ray_ckpt.control.asgi import ASGIApp

# How long a graceful stop lets in-flight data requests finish.
DEFAULT_DRAIN_S = 10.0


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: the kernel picks), bound now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class Serving(Protocol):
    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (bounded), close sockets."""
        ...


class _AiohttpServing:
    def __init__(self, runner: web.AppRunner) -> None:
        self._runner = runner

    async def stop(self) -> None:
        # cleanup() closes the listening site, waits for running handlers up to
        # the runner's shutdown_timeout, then closes the remaining connections.
        await self._runner.cleanup()


class _UvicornServing:
    def __init__(self, server: Any, task: asyncio.Task[None]) -> None:
        self._server = server
        self._task = task

    async def stop(self) -> None:
        self._server.should_exit = True
        try:
            await self._task
        except asyncio.CancelledError:
            if not self._task.cancelled():
                raise


async def serve_app(
    app: web.Application | ASGIApp, sock: socket.socket, *, drain_s: float = DEFAULT_DRAIN_S
) -> Serving:
    """Serve `app` on the bound socket in the running loop until `stop()`."""
    if isinstance(app, web.Application):
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=drain_s)
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
        except BaseException:
            await runner.cleanup()
            raise
        return _AiohttpServing(runner)
    return await _serve_asgi(app, sock, drain_s)


async def _serve_asgi(app: ASGIApp, sock: socket.socket, drain_s: float) -> Serving:
    import uvicorn

    config = uvicorn.Config(
        app,
        loop="none",  # the actor's loop is already running
        lifespan="off",
        log_config=None,  # leave the host process's logging alone
        access_log=False,
        timeout_graceful_shutdown=max(int(drain_s), 1),
    )
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    # Startup is quick; wait so a failed start is raised here, not lost.
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("uvicorn stopped before it started")
        await asyncio.sleep(0.01)
    return _UvicornServing(server, task)


def socket_address(sock: socket.socket) -> tuple[str, int]:
    host, port = sock.getsockname()[:2]
    return str(host), int(port)
