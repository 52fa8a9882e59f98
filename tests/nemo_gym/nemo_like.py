"""A tiny server shaped like a NeMo Gym resources server, for the main venv.

Written here, not taken from nemo_gym: a pydantic model whose
`setup_webserver()` builds a FastAPI app with the same session handling as
NeMo Gym's `SimpleServer` (Starlette's `SessionMiddleware` with a signed
cookie, and an inner middleware that gives a new session a random UUID under
``session_id``), per-session state in dict fields keyed by that ID, and
Gymnasium-style ``/reset`` and ``/step`` routes.  Each tool call can be held
on an event, so a test can keep one in flight.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.middleware.sessions import SessionMiddleware

SESSION_ID_KEY = "session_id"


class SeedBody(BaseModel):
    initial_count: int = 0
    seed: int = 0


class CountBody(BaseModel):
    count: int


class StepBody(BaseModel):
    action: int


class CounterServer(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    session_id_to_counter: dict[str, int] = Field(default_factory=dict)
    session_id_to_rng: dict[str, Any] = Field(default_factory=dict)
    hold: Any = None  # an asyncio.Event tool calls wait on, when set by a test
    entered: int = 0
    arrived: Any = None  # an asyncio.Event set by every tool call (made on first wait)

    def setup_webserver(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def add_session_id(
            request: Request, call_next: Callable[[Request], Awaitable[Response]]
        ) -> Response:
            request.session[SESSION_ID_KEY] = request.session.get(SESSION_ID_KEY, str(uuid.uuid4()))
            return await call_next(request)

        app.add_middleware(SessionMiddleware, secret_key="test-secret", session_cookie="sess")
        app.post("/seed_session")(self.seed_session)
        app.post("/increment_counter")(self.increment_counter)
        app.post("/get_counter_value")(self.get_counter_value)
        app.post("/verify")(self.verify)
        app.post("/reset")(self.seed_session)
        app.post("/step")(self.step)
        app.get("/whoami")(self.whoami)
        return app

    def setup_liveness(self, app: FastAPI) -> None:
        app.get("/")(lambda: {"status": "ok"})

    async def seed_session(self, request: Request, body: SeedBody) -> dict[str, Any]:
        sid = request.session[SESSION_ID_KEY]
        self.session_id_to_counter[sid] = body.initial_count
        self.session_id_to_rng[sid] = random.Random(body.seed)
        return {}

    async def increment_counter(self, request: Request, body: CountBody) -> dict[str, Any]:
        sid = request.session[SESSION_ID_KEY]
        self.entered += 1
        if self.arrived is not None:
            self.arrived.set()
        if self.hold is not None:
            await self.hold.wait()
        self.session_id_to_counter[sid] = self.session_id_to_counter.get(sid, 0) + body.count
        return {"success": True}

    async def get_counter_value(self, request: Request) -> dict[str, Any]:
        sid = request.session[SESSION_ID_KEY]
        rng = self.session_id_to_rng.get(sid)
        draw = rng.randrange(1000) if rng is not None else None
        return {"count": self.session_id_to_counter.get(sid, 0), "draw": draw}

    async def verify(self, request: Request) -> dict[str, Any]:
        sid = request.session[SESSION_ID_KEY]
        return {"reward": float(self.session_id_to_counter.get(sid, 0))}

    async def step(self, request: Request, body: StepBody) -> dict[str, Any]:
        sid = request.session[SESSION_ID_KEY]
        total = self.session_id_to_counter.get(sid, 0) + body.action
        self.session_id_to_counter[sid] = total
        return {"observation": str(total), "terminated": total >= 10, "truncated": False}

    async def whoami(self, request: Request) -> dict[str, Any]:
        return {"session_id": request.session[SESSION_ID_KEY]}


async def wait_entered(server: CounterServer, n: int, timeout: float = 5.0) -> None:
    if server.arrived is None:
        server.arrived = asyncio.Event()
    async with asyncio.timeout(timeout):
        while server.entered < n:
            server.arrived.clear()
            await server.arrived.wait()
