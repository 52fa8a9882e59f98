"""`NemoGymServer`: an unmodified NeMo Gym resources server as a ray-ckpt `GymServer`.

    server = StatefulCounterResourcesServer(config=..., server_client=...)
    gym = wrap(server)                  # restart-only: nobody audited its state
    gym = wrap(server, exported=True)   # its session state is checkpointed

The server's own code is untouched: its FastAPI app is built with
`setup_webserver()` and put behind an `EpisodeFront` (prefix, admission,
sessions keyed by capture key, see `participants.nemo_gym.front`).

**Restart-only** (the default) exports nothing, never blocks a checkpoint and
reports every live session as a restart; its seed replies say so with
``x-ng-checkpoint-restart: 1``, so callers start those episodes over.
**Exported** checkpoints the server's per-session state: the dict fields of
the server keyed by session ID (by default every field whose name contains
``session``, e.g. ``session_id_to_counter`` or `GymnasiumServer`'s
``session_state``; or the names given), each session's values encoded by the
server's `Codecs`.  A field may have its own codec (`field_codecs`), for a
value whose parts must be rebuilt together (objects sharing references).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from participants.nemo_gym.codecs import Codecs, SessionCodec
from participants.nemo_gym.finished import WrappedResources
from participants.nemo_gym.front import EpisodeFront, bind_sessions, has_route
from participants.resources import ResourcesMode
from ray_ckpt.control.asgi import ASGIApp
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.identity import EpisodeId
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.steps import StepMode, step_mode


def session_fields(server: Any) -> list[str]:
    """The server's dict fields keyed by session ID: those named ``*session*``."""
    fields = getattr(type(server), "model_fields", {})
    return sorted(
        name for name in fields if "session" in name and isinstance(getattr(server, name), dict)
    )


class SessionStates:
    """The `SessionHooks` of a NeMo Gym server: its session-keyed dict fields."""

    def __init__(
        self,
        server: Any,
        fields: Sequence[str],
        codecs: Codecs,
        field_codecs: Mapping[str, SessionCodec] | None = None,
    ) -> None:
        for name in fields:
            if not isinstance(getattr(server, name, None), dict):
                raise ValueError(f"{type(server).__name__}.{name} is not a dict of sessions")
        self.server = server
        self.fields = tuple(fields)
        self.codecs = codecs
        self.field_codecs = dict(field_codecs or {})
        unknown = set(self.field_codecs) - set(self.fields)
        if unknown:
            raise ValueError(f"field codecs for fields that are not exported: {sorted(unknown)}")

    def _table(self, name: str) -> dict[str, Any]:
        table: dict[str, Any] = getattr(self.server, name)
        return table

    def encode_session(self, key: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.fields:
            table = self._table(name)
            if key not in table:  # only the key the front bound: no UUID is ever parsed
                continue
            value = table[key]
            codec = self.field_codecs.get(name)
            if codec is not None:
                try:
                    value = codec.encode(value)
                except InvalidCheckpointState as exc:
                    raise InvalidCheckpointState(
                        f"episode {key}: state.{name}: {exc.detail}"
                    ) from None
            out[name] = self.codecs.encode(value, path=f"state.{name}", episode=key)
        return out

    def decode_session(self, key: str, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict) or not set(data) <= set(self.fields):
            names = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise InvalidCheckpointState(
                f"session {key}: holds {names}; this server exports {list(self.fields)}"
            )
        out: dict[str, Any] = {}
        for name, encoded in data.items():
            value = self.codecs.decode(encoded, path=f"session {key}: state.{name}")
            codec = self.field_codecs.get(name)
            if codec is not None:
                try:
                    value = codec.decode(value)
                except InvalidCheckpointState:
                    raise
                except Exception as exc:
                    raise InvalidCheckpointState(
                        f"session {key}: state.{name}: its codec failed: {exc!r}"[:500]
                    ) from None
            out[name] = value
        return out

    async def export_session_states(self, keys: Sequence[EpisodeId]) -> dict[EpisodeId, Any]:
        return {k: self.encode_session(k.capture_key) for k in keys}

    async def restore_session_states(self, states: Mapping[EpisodeId, Any]) -> None:
        decoded = {k: self.decode_session(k.capture_key, s) for k, s in states.items()}
        for key, values in decoded.items():  # all decoded first: never a partial install
            for name, value in values.items():
                self._table(name)[key.capture_key] = value

    async def retire_session_state(self, key: EpisodeId) -> None:
        for name in self.fields:
            self._table(name).pop(key.capture_key, None)


class NemoGymServer:
    """A `GymServer` hosting one unmodified NeMo Gym resources server."""

    kind = "resources"

    def __init__(
        self,
        server: Any,
        *,
        exported: bool | Sequence[str] = False,
        codecs: Codecs | None = None,
        field_codecs: Mapping[str, SessionCodec] | None = None,
        verify_mode: str = "wait",
    ) -> None:
        self.server = server
        if isinstance(exported, str):
            exported = [exported]
        fields = session_fields(server) if exported is True or exported is False else list(exported)
        self.codecs = codecs if codecs is not None else Codecs()
        self.states = SessionStates(server, fields, self.codecs, field_codecs)
        mode = ResourcesMode.EXPORTED if exported else ResourcesMode.RESTART_ONLY
        self.participant = WrappedResources(self.states, mode=mode)
        self.verify_mode: StepMode = step_mode(verify_mode)
        self.front: EpisodeFront | None = None

    @property
    def mode(self) -> ResourcesMode:
        return self.participant.mode

    def app(self) -> ASGIApp:
        """The server's FastAPI app behind the episode front (built once)."""
        if self.front is None:
            app = self.server.setup_webserver()
            setup_liveness = getattr(self.server, "setup_liveness", None)
            if callable(setup_liveness):
                setup_liveness(app)  # GET /, as NeMo Gym's own launcher adds it
            cookie = bind_sessions(app)
            self.front = EpisodeFront(
                app,
                self.participant,
                verify_mode=self.verify_mode,
                own_close=not has_route(app, "/close_session"),
                session_cookie=cookie,
            )
        return self.front

    def attach(self, engine: ParticipantEngine) -> None:
        self.app()
        assert self.front is not None
        self.front.engine = engine

    async def aclose(self) -> None:
        """Nothing to release: the server's state lives in this process."""

    def sidecar_app(self, settings: CheckpointSettings, *, instance: str) -> ASGIApp:
        """Sidecar mode: the app with the control routes in front, for the
        server's own uvicorn process (`ray_ckpt.hosting.sidecar.SidecarHost`
        forwards to it)."""
        from ray_ckpt.hosting.sidecar import wrap_asgi_sidecar

        app, engine = wrap_asgi_sidecar(self.app(), self.participant, settings, instance=instance)
        if engine is not None:
            self.attach(engine)
        return app


def wrap(
    server: Any,
    *,
    exported: bool | Sequence[str] = False,
    codecs: Codecs | None = None,
    field_codecs: Mapping[str, SessionCodec] | None = None,
    verify_mode: str = "wait",
) -> NemoGymServer:
    """An unmodified NeMo Gym resources server, ready for a `ParticipantHost`.

    `exported`: False (restart-only, the default), True (its ``*session*``
    dict fields) or the field names to checkpoint.  `verify_mode`: "replay"
    only when the server's `/verify` is pure.
    """
    return NemoGymServer(
        server,
        exported=exported,
        codecs=codecs,
        field_codecs=field_codecs,
        verify_mode=verify_mode,
    )
