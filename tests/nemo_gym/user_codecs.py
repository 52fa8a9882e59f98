"""Codecs a user of the real servers writes (imported by the host actor only).

Nothing here edits a server: each is a `SessionCodec` registered for the
server's own types, named in a `ServerSpec` by import path.

- grl_sokoban keeps a `SokobanEnv` (a gym_sokoban environment: numpy room
  arrays, a dict with tuple-of-numpy keys, gymnasium spaces) in each session:
  its codec saves the room and counters and rebuilds the environment from
  its saved config.
- workplace_assistant keeps a tool environment per session: tool objects
  holding pandas DataFrames plus bound methods of those same objects.  Its
  field codec saves each tool object's attributes (DataFrames through the
  built-in codec) and rebuilds the environment with the server's own
  `get_tools`, so the methods stay bound to the restored objects.
"""

from __future__ import annotations

from typing import Any

from participants.nemo_gym import AttributesCodec, Codecs, SessionCodec

SOKOBAN_ATTRS = (
    "config",
    "room_fixed",
    "room_state",
    "box_mapping",
    "num_env_steps",
    "reward_last",
    "boxes_on_target",
    "player_position",
)


def sokoban_codecs() -> Codecs:
    from resources_servers.grl_sokoban.sokoban_env import SokobanEnv

    codecs = Codecs()
    codecs.register(
        SokobanEnv,
        AttributesCodec(SokobanEnv, SOKOBAN_ATTRS, make=lambda attrs: SokobanEnv(attrs["config"])),
        tag="grl_sokoban.SokobanEnv",
    )
    return codecs


class ToolEnvCodec:
    def encode(self, env: dict[str, Any]) -> Any:
        containers = env["containers"]
        return {
            "toolkits": [name for name in containers if name != "company_directory"],
            "containers": {name: dict(vars(tool)) for name, tool in containers.items()},
        }

    def decode(self, data: Any) -> dict[str, Any]:
        from resources_servers.workplace_assistant.utils import get_tools

        env: dict[str, Any] = get_tools(data["toolkits"])
        for name, attrs in data["containers"].items():
            vars(env["containers"][name]).update(attrs)
        return env


def workplace_field_codecs() -> dict[str, SessionCodec]:
    return {"session_id_to_tool_env": ToolEnvCodec()}
