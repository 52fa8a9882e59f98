"""Building a NeMo Gym server inside a `ParticipantHost`: the spec's factory.

    ServerSpec(
        kind="resources",
        name="counter",
        factory="participants.nemo_gym:hosted",
        options={
            "server": "resources_servers.grl_sokoban.app:GrlSokobanResourcesServer",
            "exported": True,
        },
        settings=settings_dict(settings),
    )

The host process imports the server class by name, so the module must be
importable there (installed, or shipped with a Ray `runtime_env`'s
`working_dir` / `py_modules`).  NeMo Gym normally builds a server's config
from its global YAML config and launches it with `run_webserver()`; here the
config is the spec's `config` option (host, port and entrypoint are filled
in: the host serves on its own socket) and the server gets a `ServerClient`
with an empty global config, which is all a server that calls no other
server needs.  A server that calls others takes a factory of your own that
builds the `ServerClient` and calls `wrap`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from participants.nemo_gym.codecs import Codecs
from participants.nemo_gym.server import NemoGymServer, wrap
from ray_ckpt.gym_server.spec import import_factory
from ray_ckpt.settings import CheckpointSettings


def standalone_client() -> Any:
    """A `ServerClient` for a server that calls no other server."""
    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.server_utils import ServerClient
    from omegaconf import OmegaConf

    head = BaseServerConfig(host="127.0.0.1", port=0)
    return ServerClient(head_server_config=head, global_config_dict=OmegaConf.create({}))


def build_server(
    cls: Any, *, name: str, config: Mapping[str, Any] | None = None, server_client: Any = None
) -> Any:
    """An instance of a NeMo Gym server class, its config validated by its own model."""
    config_cls = cls.model_fields["config"].annotation
    data = {"host": "127.0.0.1", "port": 0, "entrypoint": "app.py", "name": name, **(config or {})}
    client = standalone_client() if server_client is None else server_client
    return cls(config=config_cls.model_validate(data), server_client=client)


def hosted(
    *,
    name: str,
    settings: CheckpointSettings,
    server: str,
    config: Mapping[str, Any] | None = None,
    exported: bool | list[str] = False,
    codecs: str | None = None,
    field_codecs: str | None = None,
    verify_mode: str = "wait",
) -> NemoGymServer:
    """The `ServerSpec` factory: `server` is ``"module:Class"``; `codecs` names a
    function returning the server's `Codecs`, `field_codecs` one returning
    ``{field: codec}``."""
    instance = build_server(import_factory(server), name=name, config=config)
    registry: Codecs | None = import_factory(codecs)() if codecs else None
    per_field = import_factory(field_codecs)() if field_codecs else None
    return wrap(
        instance,
        exported=exported,
        codecs=registry,
        field_codecs=per_field,
        verify_mode=verify_mode,
    )
