"""What a worker process is started with (sent on its stdin, never on argv:
the spec's settings hold the control token)."""

from __future__ import annotations

import msgspec

from ray_ckpt.gym_server.spec import ServerSpec
from ray_ckpt.workers.frames import DEFAULT_MAX_FRAME_BYTES

# Reports also go out at least this often, as a heartbeat.
HEARTBEAT_S = 1.0


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    spec: ServerSpec
    index: int
    workers: int
    socket_path: str  # the host's Unix socket
    listen_fd: int  # the shared port, inherited
    control_url: str | None  # the host's control port (None: checkpointing off)
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    heartbeat_s: float = HEARTBEAT_S


def encode_config(config: WorkerConfig) -> bytes:
    return msgspec.msgpack.encode(config)


def decode_config(raw: bytes) -> WorkerConfig:
    return msgspec.msgpack.decode(raw, type=WorkerConfig)
