"""Participants of every kind and the reference Gym servers.

- participant hooks per kind: `PolicyModelParticipant`, `AgentParticipant`,
  `ResourcesParticipant` (+ `SessionHooks`, `ResourcesMode`); the environment
  uses `ray_ckpt.steps.episode_participant.EpisodeParticipant` over `EpisodeSteps`;
- reference servers (GymServer factories) in `participants.servers.*`;
- `launch_fleet` (Ray hosts) and `start_local_fleet` (in-process);
  `participants.fleet_relaunch.FleetRelauncher` moves the fleet off draining
  nodes;
- `participants.nemo_gym`: real, unmodified NeMo Gym servers (`wrap`, session
  codecs);
- the engine-side driver: `run_episode`, `make_tasks`, `result_digest`.
"""

from participants.agent import AgentParticipant
from participants.fleet import FACTORIES, KIND_ORDER, START_ORDER, Fleet, FleetConfig, launch_fleet
from participants.local import LocalFleet, start_local_fleet
from participants.model_calls import Cut
from participants.policy_model import PolicyModelParticipant
from participants.resources import ResourcesMode, ResourcesParticipant, SessionHooks
from participants.rollout import make_tasks, result_digest, run_episode

__all__ = [
    "FACTORIES",
    "KIND_ORDER",
    "START_ORDER",
    "AgentParticipant",
    "Cut",
    "Fleet",
    "FleetConfig",
    "LocalFleet",
    "PolicyModelParticipant",
    "ResourcesMode",
    "ResourcesParticipant",
    "SessionHooks",
    "launch_fleet",
    "make_tasks",
    "result_digest",
    "run_episode",
    "start_local_fleet",
]
