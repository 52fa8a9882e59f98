"""Coordination, the trainer's side: the handle (`connect`, `aconnect`), the
Coordinator actor and its Ray-free core, participant order, checkpoints on a
timer, a signal or a node drain, metrics and timelines, the `ray-ckpt` CLI and
the main job (`coordination.demo`)."""

from coordination.connect import aconnect, connect
from coordination.handle import CoordinatorHandle

__all__ = ["CoordinatorHandle", "aconnect", "connect"]
