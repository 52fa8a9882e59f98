"""ray-ckpt core: identity, phases, errors, settings, wire types, storage, steps."""

from ray_ckpt.clock import Clock, ManualClock, SystemClock
from ray_ckpt.errors import CheckpointError, Reason
from ray_ckpt.identity import EpisodeId, parse_rollout_path, rollout_path
from ray_ckpt.records import Record, check_json
from ray_ckpt.settings import CheckpointSettings, load_settings, settings_from_dict

__all__ = [
    "CheckpointError",
    "CheckpointSettings",
    "Clock",
    "EpisodeId",
    "ManualClock",
    "Reason",
    "Record",
    "SystemClock",
    "check_json",
    "load_settings",
    "parse_rollout_path",
    "rollout_path",
    "settings_from_dict",
]
