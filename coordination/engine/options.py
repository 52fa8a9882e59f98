"""`CheckpointOptions`: everything one checkpoint is asked to be, as one value.

The handle builds it, the actor carries it, the engine checks it once
(`check`) before anyone is paused and runs from it; no layer restates the
parameters or their rules.  Typed (msgspec), so it crosses Ray as itself.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from coordination.engine.baseline import Trigger
from ray_ckpt.errors import InvalidRequest
from ray_ckpt.identity import EpisodeId

Durability = Literal["sync", "async"]


class CheckpointOptions(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_dir: str
    # The episodes it continues; None: the registered assembler's in flight
    # (asked after the prepare), else everything the participants export.
    scope: list[EpisodeId] | None = None
    # False: left open (committed) for the trainer to publish; `resume()` after.
    resume: bool = True
    # The participants park what the exported episodes hold (a drain moves them).
    stop: bool = False
    # Refuse (`RestartInScope`, nothing published) if an episode of the scope
    # has no state anywhere.
    strict: bool = False
    prepare_s: float | None = None
    commit_s: float | None = None
    # The whole checkpoint's budget from the call: phase deadlines cut to fit,
    # and one not ready to publish inside it fails whole.
    total_s: float | None = None
    trigger: str = Trigger.MANUAL.value
    # "async": returned once the Gym resumed; the writes and the Gym manifest follow.
    durability: Durability = "sync"

    def check(self) -> CheckpointOptions:
        """`InvalidRequest` naming the first rule broken; else itself."""
        if not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir:
            raise InvalidRequest(f"checkpoint_dir must be a location, not {self.checkpoint_dir!r}")
        if self.durability not in ("sync", "async"):
            raise InvalidRequest(f"durability must be sync or async, not {self.durability!r}")
        if self.durability == "async" and (
            self.stop or not self.resume or self.total_s is not None
        ):
            raise InvalidRequest(
                "durability async resumes the Gym before the write is durable: "
                "not with stop, resume=False or total_s"
            )
        if self.strict and self.stop:
            # A stopping commit frees what its exported episodes hold before the
            # strict check could refuse it; the refused checkpoint resumes them.
            raise InvalidRequest("strict and stop cannot be combined")
        for name in ("prepare_s", "commit_s", "total_s"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidRequest(f"{name} must be a number of seconds, not {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise InvalidRequest(f"{name} must be positive, not {value!r}")
        if not isinstance(self.trigger, str) or not self.trigger:
            raise InvalidRequest(f"trigger must be a name, not {self.trigger!r}")
        return self
