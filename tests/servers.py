"""Tiny Gym servers for hosting tests (not the reference servers in `participants/`).

Each keeps a table of "episodes": a data route stores a state under a capture
key, and every episode is always at a boundary, so prepare is immediate, and
a commit exports what the table holds, which a restore installs under
attempt + 1.  Data routes: `GET /echo?msg=`, `PUT /episodes/{key}` (JSON
state), `GET /episodes`, `GET /slow?s=` (sleeps, for drain tests).

`python -m tests.servers` runs the aiohttp one as its own process
in sidecar mode (settings as JSON in `RAY_CKPT_TEST_SETTINGS`, so the token
is not on the command line) and prints `URL <base url>` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from ray_ckpt.control.asgi import ASGIApp
from ray_ckpt.errors import AdmissionClosed, CheckpointError
from ray_ckpt.gym_server.serving import bind_socket, serve_app, socket_address
from ray_ckpt.identity import EpisodeId
from ray_ckpt.reports import PrepareReport
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.storage.records.record import Record

if TYPE_CHECKING:
    from ray_ckpt.control.engine import ParticipantEngine

SETTINGS_ENV = "RAY_CKPT_TEST_SETTINGS"


class TableParticipant:
    """Participant hooks over a key → state table; always ready."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.table: dict[str, Any] = {}
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
        return True

    def report(self, limit: int) -> PrepareReport:
        return PrepareReport(ready=True, counts={"episodes": len(self.table)})

    def live_executions(self) -> int:
        return 0

    def fresh(self) -> bool:
        return not self.served and not self.restored

    async def export(self, scope: Sequence[EpisodeId] | None) -> list[Record]:
        return [Record(key, state) for key, state in sorted(self.table.items())]

    async def install(self, records: Sequence[Record]) -> list[EpisodeId]:
        nxt = [r.episode_id.next() for r in records]
        for record, episode in zip(records, nxt, strict=True):
            self.table[episode.capture_key] = record.state
        self.restored = True
        return nxt

    async def retire(self, episode_ids: Sequence[EpisodeId]) -> list[str]:
        gone = []
        for episode in episode_ids:
            for key in list(self.table):
                k = EpisodeId.from_capture_key(key)
                if k.rollout_id == episode.rollout_id and k.attempt <= episode.attempt:
                    del self.table[key]
                    gone.append(key)
        return gone

    async def delete_restored(self, keep: Sequence[EpisodeId]) -> list[str]:
        return []

    def put(self, key: str, state: Any, engine: ParticipantEngine | None) -> None:
        """A data call: refused while admission is closed or for a retired attempt."""
        if not self.admission_open:
            raise AdmissionClosed("a checkpoint is in progress")
        episode = EpisodeId.from_capture_key(key)
        if engine is not None:
            engine.retired.check(episode)
        self.served = True
        self.table[key] = state
        self._notify()


class _TableServer:
    def __init__(self, kind: str, name: str) -> None:
        self.kind = kind
        self.name = name
        self.participant = TableParticipant(kind)
        self.engine: ParticipantEngine | None = None
        self.closed = False

    def attach(self, engine: ParticipantEngine) -> None:
        self.engine = engine

    async def aclose(self) -> None:
        self.closed = True


class AiohttpTableServer(_TableServer):
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/echo", self._echo)
        app.router.add_put("/episodes/{key}", self._put)
        app.router.add_get("/episodes", self._list)
        app.router.add_get("/slow", self._slow)
        return app

    async def _echo(self, request: web.Request) -> web.Response:
        return web.json_response({"echo": request.query.get("msg", ""), "server": self.name})

    async def _put(self, request: web.Request) -> web.Response:
        try:
            self.participant.put(request.match_info["key"], await request.json(), self.engine)
        except CheckpointError as exc:
            return web.json_response(exc.to_body(), status=exc.http_status)
        return web.json_response({"stored": request.match_info["key"]})

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response(self.participant.table)

    async def _slow(self, request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query.get("s", "1")))
        return web.json_response({"slept": True})


class FastAPITableServer(_TableServer):
    def app(self) -> ASGIApp:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        api = FastAPI()

        @api.get("/echo")
        async def echo(msg: str = "") -> dict[str, str]:
            return {"echo": msg, "server": self.name}

        async def put(request: Request) -> JSONResponse:
            key = request.path_params["key"]
            try:
                self.participant.put(key, orjson.loads(await request.body()), self.engine)
            except CheckpointError as exc:
                return JSONResponse(exc.to_body(), status_code=exc.http_status)
            return JSONResponse({"stored": key})

        # A plain Starlette route: FastAPI cannot resolve a `Request` annotation
        # imported inside this function (annotations are strings here), and
        # would take `request` for a query parameter.
        api.router.add_route("/episodes/{key}", put, methods=["PUT"])

        @api.get("/episodes")
        async def episodes() -> dict[str, Any]:
            return self.participant.table

        @api.get("/slow")
        async def slow(s: float = 1.0) -> dict[str, bool]:
            await asyncio.sleep(s)
            return {"slept": True}

        @api.get("/block")
        async def block(s: float = 0.1) -> dict[str, int]:
            time.sleep(s)  # noqa: ASYNC251 -- holds the event loop, as CPU work does
            return {"pid": os.getpid()}

        return api


def aiohttp_server(
    *, name: str, settings: CheckpointSettings, kind: str = "environment"
) -> AiohttpTableServer:
    return AiohttpTableServer(kind, name)


def fastapi_server(
    *, name: str, settings: CheckpointSettings, kind: str = "environment"
) -> FastAPITableServer:
    return FastAPITableServer(kind, name)


# --- a sidecar-mode server process ---------------------------------------------


async def _run_sidecar(kind: str, name: str, host: str, port: int) -> None:
    from ray_ckpt.hosting.sidecar import install_sidecar

    settings = CheckpointSettings.model_validate_json(os.environ.get(SETTINGS_ENV, "{}"))
    server = AiohttpTableServer(kind, name)
    app = server.app()
    engine = install_sidecar(app, server.participant, settings, instance=name)
    if engine is not None:
        server.attach(engine)
    sock = bind_socket(host, port)
    bound_host, bound_port = socket_address(sock)
    serving = await serve_app(app, sock, drain_s=2.0)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"URL http://{bound_host}:{bound_port}", flush=True)
    try:
        await stop.wait()
    finally:
        await serving.stop()
        sock.close()
        await server.aclose()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kind", default="environment")
    parser.add_argument("--name", default="sidecar")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    asyncio.run(_run_sidecar(args.kind, args.name, args.host, args.port))
    sys.exit(0)


if __name__ == "__main__":
    main()
