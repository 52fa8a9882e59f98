"""Coordination, the trainer's side: the handle (`connect`, `aconnect`), the
Coordinator actor and its Ray-free core, participant order, checkpoints on a
timer, a signal or a node drain, metrics and timelines, the `ray-ckpt` CLI and
the main job (`coordination.demo`)."""

from coordination.client.connect import aconnect, connect
from coordination.client.handle import CoordinatorHandle

__all__ = ["CoordinatorHandle", "aconnect", "connect"]
