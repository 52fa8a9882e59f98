"""Hosting real, unmodified NeMo Gym servers: one wrapper and session codecs.

- `wrap(server, exported=...)` — a NeMo Gym resources server (including
  `GymnasiumServer` environments and `SESSION_ID_KEY` session-state servers)
  as a `GymServer` for `ParticipantHost` (hosted) or its own process
  (`NemoGymServer.sidecar_app`);
- `hosted` — the same as a `ServerSpec` factory (``"participants.nemo_gym:hosted"``);
- `SessionCodec`, `Codecs`, `AttributesCodec` — how non-JSON session state
  (`random.Random`, numpy, pandas, dataclasses, pydantic models) is
  checkpointed, and how to teach it a type of your own.

nemo_gym itself is imported only by `hosted` (the server classes are yours).
"""

from participants.nemo_gym.builtin_codecs import AttributesCodec
from participants.nemo_gym.codecs import Codecs, SessionCodec, type_name
from participants.nemo_gym.factory import build_server, hosted, standalone_client
from participants.nemo_gym.front import SESSION_ID_KEY, EpisodeFront, bind_sessions
from participants.nemo_gym.server import NemoGymServer, SessionStates, session_fields, wrap

__all__ = [
    "SESSION_ID_KEY",
    "AttributesCodec",
    "Codecs",
    "EpisodeFront",
    "NemoGymServer",
    "SessionCodec",
    "SessionStates",
    "bind_sessions",
    "build_server",
    "hosted",
    "session_fields",
    "standalone_client",
    "type_name",
    "wrap",
]
