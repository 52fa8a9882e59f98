"""ray-ckpt core: identity, phases, errors, settings, the control plane, records, steps.

The core knows nothing of participant kinds: `participants` implements the
hooks per kind and `coordination` drives the ordered phases across them.
Heavy pieces (Ray hosts, storage backends, wire bodies) are imported from
their modules: `ray_ckpt.hosting.host`, `ray_ckpt.hosting.sidecar`,
`ray_ckpt.storage`, `ray_ckpt.control.wire`, `ray_ckpt.reports`.
"""

from ray_ckpt.clock import Clock, ManualClock, SystemClock
from ray_ckpt.control.asgi import ControlASGIMiddleware
from ray_ckpt.control.client import ControlClient, data_session
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.control.phase_machine import Phase
from ray_ckpt.control.protocol import KINDS, Participant
from ray_ckpt.control.routes import (
    CHECKPOINT_ROUTE_PREFIX,
    install_control_routes,
    maybe_install_control_routes,
)
from ray_ckpt.errors import CheckpointError, Reason
from ray_ckpt.identity import EpisodeId, parse_rollout_path, rollout_path
from ray_ckpt.settings import CheckpointSettings, load_settings, settings_from_dict
from ray_ckpt.steps import EpisodeSteps, StepMode
from ray_ckpt.steps.episode_participant import EpisodeParticipant
from ray_ckpt.storage.records.record import Record, check_json

__all__ = [
    "CHECKPOINT_ROUTE_PREFIX",
    "KINDS",
    "CheckpointError",
    "CheckpointSettings",
    "Clock",
    "ControlASGIMiddleware",
    "ControlClient",
    "EpisodeId",
    "EpisodeParticipant",
    "EpisodeSteps",
    "ManualClock",
    "Participant",
    "ParticipantEngine",
    "Phase",
    "Reason",
    "Record",
    "StepMode",
    "SystemClock",
    "check_json",
    "data_session",
    "install_control_routes",
    "load_settings",
    "maybe_install_control_routes",
    "parse_rollout_path",
    "rollout_path",
    "settings_from_dict",
]
