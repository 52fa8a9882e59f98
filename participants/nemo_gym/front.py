"""The data-plane front of a hosted NeMo Gym app: episodes from the rollout prefix.

A NeMo Gym resources server knows nothing of episodes: its routes are
``/seed_session``, ``/verify``, tools, and for `GymnasiumServer` environments
``/reset`` and ``/step``, and it keys per-session state by a random UUID it
keeps in a signed cookie.  `EpisodeFront` is a pure ASGI app in front of it:

- a request under ``/ng-rollout/<capture-key>/`` is the episode attempt the
  key names: retired and superseded attempts are refused (`stale_attempt`),
  the request is admitted through the participant (it waits while a
  checkpoint is open and counts as in flight until it ends), and it reaches
  the app with the prefix stripped;
- its session is the capture key: `bind_sessions` puts a layer inside the
  app's `SessionMiddleware` that sets the session ID to the key the front
  parsed, so state lands under ``"r-a1"`` instead of a fresh UUID.  The key
  travels in the ASGI scope, never through the cookie: a cookie's UUID is
  never parsed as a capture key (some UUIDs end in ``-a<digits>``);
- a successful seed (``/seed_session``, ``/reset``) binds the session and
  says how it checkpoints (``x-ng-checkpoint-verify``, and
  ``x-ng-checkpoint-restart: 1`` when restart-only); a successful
  ``/verify``, or a ``/step`` reply with ``terminated``/``truncated``,
  finishes the episode (no longer live; its state stays with the server,
  whose later replies are its own: see `participants.nemo_gym.finished`),
  and ``/close_session`` or a retire frees it;
- ``/close_session`` never waits and is never refused; the front answers it
  itself when the app has no such route.

Requests without the prefix (liveness, ``/aggregate_metrics``) pass through
untouched, with the server's own cookie sessions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import orjson

from participants.nemo_gym.finished import WrappedResources
from participants.resources import ResourcesMode
from ray_ckpt.control.asgi import ASGIApp, Message, Receive, Scope, Send, send_error, send_json
from ray_ckpt.errors import CheckpointError, InvalidRequest
from ray_ckpt.identity import EpisodeId, parse_rollout_path
from ray_ckpt.steps import StepMode, seed_session_headers

if TYPE_CHECKING:
    from ray_ckpt.control.engine import ParticipantEngine

# Where the front leaves the capture key for the session layer (an ASGI scope extension).
SCOPE_KEY = "ray_ckpt.capture_key"
# NeMo Gym's `nemo_gym.server_utils.SESSION_ID_KEY` (kept here: no import of nemo_gym).
SESSION_ID_KEY = "session_id"
SEED_ROUTES = ("/seed_session", "/reset")
END_ROUTES = ("/verify",)
TERMINAL_ROUTES = ("/step",)
CLOSE_ROUTE = "/close_session"
# A /step reply is read to see whether the episode ended; larger ones are not buffered.
_MAX_TERMINAL_BODY = 4 * 1024 * 1024


class _SessionBinder:
    """Inside `SessionMiddleware`: the session ID of a prefixed request is its capture key."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = scope.get(SCOPE_KEY)
        session = scope.get("session")
        if isinstance(key, str) and isinstance(session, dict):
            session[SESSION_ID_KEY] = key
        await self.app(scope, receive, send)


def bind_sessions(app: Any) -> str | None:
    """Put the session layer right inside the app's `SessionMiddleware`.

    Returns the session cookie's name, or None when the app has no
    `SessionMiddleware` (it keeps no cookie sessions).  Must run before the
    app serves its first request (Starlette builds its middleware stack then
    and refuses changes after).
    """
    from starlette.middleware import Middleware
    from starlette.middleware.sessions import SessionMiddleware

    if getattr(app, "middleware_stack", None) is not None:
        raise RuntimeError("the app already serves: wrap it before it starts")
    layers = app.user_middleware
    for i, layer in enumerate(layers):
        if layer.cls is SessionMiddleware:
            layers.insert(i + 1, Middleware(_SessionBinder))
            return str(layer.kwargs.get("session_cookie", "session"))
    return None


def has_route(app: Any, path: str) -> bool:
    return any(getattr(route, "path", None) == path for route in getattr(app, "routes", ()))


class _Reply:
    """Forwards the app's reply, acting on it before the caller can see it.

    The session is bound (seed), finished (verify) or freed (close) when
    the reply's start passes, and a terminal `/step` finishes it before its
    last body chunk: the handler is done with the state by then, and a caller
    that reacts to the reply (a retire right after a seed) finds the session
    already known.
    """

    def __init__(
        self,
        front: EpisodeFront,
        send: Send,
        episode: EpisodeId,
        route: str,
        ticket: int | None = None,
    ) -> None:
        self._front = front
        self._ticket = ticket
        self._send = send
        self._episode = episode
        self._route = route
        self._read = route in front.terminal_routes
        self.status = 0
        self._chunks: list[bytes] = []
        self._size = 0

    async def __call__(self, message: Message) -> None:
        front = self._front
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            message = {**message, "headers": self._headers(message.get("headers", []))}
            if self.ok and self._route in front.seed_routes:
                front.participant.bind_session(self._episode)
            elif self.ok and self._route in front.end_routes:
                front.participant.finish_session(self._episode)
            elif self.ok and self._route == CLOSE_ROUTE:
                await front.participant.end_session(self._episode)
        elif message["type"] == "http.response.body" and self._read:
            chunk: bytes = message.get("body", b"")
            self._size += len(chunk)
            if self._size <= _MAX_TERMINAL_BODY:
                self._chunks.append(chunk)
            if not message.get("more_body", False) and self._ended():
                front.participant.finish_session(self._episode)
        await self._send(message)
        if (
            message["type"] == "http.response.body"
            and not message.get("more_body", False)
            and self._ticket is not None
        ):
            # Done once the caller has the whole reply: a retire from then on
            # must not cancel the app's teardown, which would close the
            # keep-alive connection other episodes' calls share.
            front.participant.leave(self._ticket)

    def _headers(self, raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        front = self._front
        headers = list(raw)
        if front.drop_cookie is not None:
            # The session cookie now names the capture key: it stays out of the
            # caller's cookie jar, so the caller's unprefixed calls keep their
            # own session.
            drop = front.drop_cookie
            headers = [
                (k, v)
                for k, v in headers
                if not (k.lower() == b"set-cookie" and v.startswith(drop))
            ]
        if self.ok and self._route in front.seed_routes:
            headers = [(k, v) for k, v in headers if k.lower() not in _seed]
            headers += [(k.encode(), v.encode()) for k, v in front.seed_headers.items()]
        return headers

    @property
    def ok(self) -> bool:
        return 0 < self.status < 400

    def _ended(self) -> bool:
        """A Gymnasium `/step` reply that says the episode is over."""
        if not self.ok or self._size > _MAX_TERMINAL_BODY:
            return False
        try:
            body = orjson.loads(b"".join(self._chunks))
        except orjson.JSONDecodeError:
            return False
        if not isinstance(body, dict):
            return False
        return body.get("terminated") is True or body.get("truncated") is True


_seed = {b"x-ng-checkpoint-verify", b"x-ng-checkpoint-restart"}


class EpisodeFront:
    """The ASGI front of one hosted NeMo Gym app (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        participant: WrappedResources,
        *,
        verify_mode: StepMode = StepMode.WAIT,
        seed_routes: Sequence[str] = SEED_ROUTES,
        end_routes: Sequence[str] = END_ROUTES,
        terminal_routes: Sequence[str] = TERMINAL_ROUTES,
        own_close: bool = True,
        session_cookie: str | None = None,
    ) -> None:
        self.app = app
        self.drop_cookie = None if session_cookie is None else f"{session_cookie}=".encode()
        self.participant = participant
        self.engine: ParticipantEngine | None = None
        self.verify_mode = verify_mode
        self.seed_routes = frozenset(seed_routes)
        self.end_routes = frozenset(end_routes)
        self.terminal_routes = frozenset(terminal_routes)
        self.own_close = own_close  # the app has no /close_session: answer it here
        restart = participant.mode is ResourcesMode.RESTART_ONLY
        self.seed_headers = seed_session_headers(verify=verify_mode, restart=restart)

    def _check(self, episode: EpisodeId) -> None:
        if self.engine is not None:
            self.engine.retired.check(episode)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            episode, route = parse_rollout_path(scope.get("path", ""))
        except InvalidRequest as exc:
            await send_error(send, exc)
            return
        if episode is None:
            await self.app(scope, receive, send)
            return
        if route == CLOSE_ROUTE:
            await self._close(episode, scope, receive, send)
            return
        try:
            self._check(episode)
        except CheckpointError as exc:
            await send_error(send, exc)
            return
        # A replayable verify may run during a checkpoint: admitted, not counted.
        counted = not (route in self.end_routes and self.verify_mode is StepMode.REPLAY)
        ticket = await self.participant.enter(episode, route, counted=counted)
        try:
            try:
                self._check(episode)  # it may have been retired while it waited
            except CheckpointError as exc:
                await send_error(send, exc)
                return
            reply = _Reply(self, send, episode, route, ticket)
            await self.app(_inner(scope, episode, route), receive, reply)
        finally:
            self.participant.leave(ticket)  # idempotent: usually left at the reply's end

    async def _close(self, episode: EpisodeId, scope: Scope, receive: Receive, send: Send) -> None:
        # Never refused (not even for a retired attempt) and never waits for
        # resume: closing only frees.
        if self.own_close:
            await send_json(send, {"closed": await self.participant.end_session(episode)})
            return
        await self.app(
            _inner(scope, episode, CLOSE_ROUTE), receive, _Reply(self, send, episode, CLOSE_ROUTE)
        )


def _inner(scope: Scope, episode: EpisodeId, route: str) -> Scope:
    """The request as the app sees it: prefix stripped, capture key alongside."""
    inner = dict(scope)
    inner["path"] = route
    inner["raw_path"] = route.encode()
    inner[SCOPE_KEY] = episode.capture_key
    return inner
