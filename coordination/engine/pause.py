"""Pausing the controller-side actors (trainer, assembler) around a checkpoint.

`ControllerPauses` holds the registered `PauseTarget`s, the pause mode and
which roles the open checkpoint has paused, so every failure path can undo
exactly what was paused.  In "full" mode prepare pauses the assembler and the
trainer; in "barrier" mode prepare pauses only the assembler and commit holds
the trainer for the commit calls alone.

A target's methods may take no arguments (NeMo RL's `AsyncTrajectoryCollector`
has ``pause()`` and ``resume()``): a Ray actor method refuses our
``(checkpoint_id, deadline_s)`` when the call is bound, before anything runs,
and the target is then called without them from then on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

from coordination.engine.fanout import failure
from coordination.engine.host import PauseTarget
from coordination.engine.results import Timeouts
from ray_ckpt.errors import CheckpointError, CoordinationFailed, DeadlineExceeded, InvalidRequest

log = logging.getLogger(__name__)

PAUSE_MODES = ("full", "barrier")


class ControllerPauses:
    def __init__(self, timeouts: Timeouts, mode: str = "full") -> None:
        self.timeouts = timeouts
        self.mode = mode
        self.targets: dict[str, PauseTarget] = {}
        self.paused: list[str] = []  # roles paused for the open checkpoint

    def register(self, target: PauseTarget, *, mode: str | None = None) -> None:
        if target.role not in ("trainer", "assembler"):
            raise InvalidRequest(f"pause role must be trainer or assembler, not {target.role!r}")
        if mode is not None:
            if mode not in PAUSE_MODES:
                raise InvalidRequest(f"pause mode must be one of {PAUSE_MODES}")
            self.mode = mode
        self.targets[target.role] = target

    def prepare_roles(self) -> tuple[str, ...]:
        return ("assembler", "trainer") if self.mode == "full" else ("assembler",)

    def commit_roles(self) -> tuple[str, ...]:
        """Held only while the commit calls run (the barrier mode's trainer)."""
        return ("trainer",) if self.mode == "barrier" else ()

    async def pause(self, cid: str, roles: Sequence[str], deadline_s: float) -> None:
        for role in roles:
            target = self.targets.get(role)
            if target is None:
                continue
            # Recorded before the call: a pause that half-happened is still undone.
            self.paused.append(role)
            try:
                await asyncio.wait_for(
                    _called(target, partial(target.pause, cid, deadline_s)), self.timeouts.pause_s
                )
            except TimeoutError:
                err: CheckpointError = DeadlineExceeded(f"{role} did not pause in time")
                raise CoordinationFailed(
                    f"pause of {role} failed", operation="pause", failures={role: failure(err)}
                ) from None
            except CheckpointError as exc:
                raise CoordinationFailed(
                    f"pause of {role} failed: {exc}",
                    operation="pause",
                    failures={role: failure(exc)},
                ) from None

    async def unpause(self, cid: str, roles: Sequence[str] | None = None) -> dict[str, Any]:
        failures: dict[str, Any] = {}
        for role in reversed(list(self.paused)):
            if roles is not None and role not in roles:
                continue
            self.paused.remove(role)
            target = self.targets.get(role)
            if target is None:
                continue
            try:
                await asyncio.wait_for(
                    _called(target, partial(target.resume, cid)), self.timeouts.pause_s
                )
            except Exception as exc:
                # Any failure of one target (a bug in it included) is reported;
                # the others are still resumed.
                if isinstance(exc, CheckpointError):
                    err = exc
                elif isinstance(exc, TimeoutError):
                    err = DeadlineExceeded(f"{role} did not resume in time")
                else:
                    err = CheckpointError(f"resume of {role} raised {exc!r}"[:500])
                failures[role] = failure(err)
                log.warning("resume of %s for %s failed: %s", role, cid, exc)
        return failures


async def _called(target: PauseTarget, call: Callable[[], Awaitable[Any]]) -> Any:
    """`call()`, once more without arguments if the target's method takes none.

    A Ray actor method raises `TypeError` while the call is bound, before it
    is submitted (remote failures arrive as `CheckpointError`), so a retry
    never runs the method twice.  A method that takes neither form is a typed
    refusal, not a `TypeError` out of the coordinator.
    """
    try:
        return await call()
    except TypeError as exc:
        if getattr(target, "pass_args", None) is not True:
            raise InvalidRequest(f"{target.role} refused the call: {exc}") from None
        target.pass_args = False  # type: ignore[attr-defined]
    try:
        return await call()
    except TypeError as exc:
        raise InvalidRequest(
            f"{target.role}: its pause/resume methods take neither "
            f"(checkpoint_id, deadline_s) nor no arguments: {exc}"
        ) from None
