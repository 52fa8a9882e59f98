"""One wrapper owns every call the coordinator makes to a participant.

A participant is reached one of three ways: a `ParticipantHost` Ray actor
(hosted or sidecar: the actor forwards to its server), an HTTP-only server
behind the bearer-protected control routes, or — in unit tests — a `FakeHost`
that drives a controller in process and can be told to hang, fail or die.
Whatever the transport, a call either returns the participant's reply as
plain builtins or raises a `CheckpointError`: the participant's own refusal,
or `ParticipantUnavailable` when it is dead or unreachable.  Cancelling a call
cancels the remote work too (`ray.cancel` for an actor task).

The trainer and trajectory-assembler actors the coordinator pauses are
wrapped here as well (`RayPauseTarget`, `FakePauseTarget`).  What the engine
needs of each is a protocol of its own (`coordination.engine.host`): the engine
imports no transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from coordination.engine.host import ControlTarget
from coordination.engine.order import Member
from ray_ckpt.control.client import ControlClient
from ray_ckpt.errors import CheckpointError, ParticipantUnavailable

Log = list[tuple[float, str, str, str]]  # (monotonic time, event, who, op)


def _unwrap_ray_error(exc: BaseException, what: str) -> CheckpointError:
    """A Ray failure as our typed error: the participant's refusal, or unavailable."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(exc, RayActorError):
        return ParticipantUnavailable(f"{what}: actor is dead or unreachable: {exc}"[:500])
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, CheckpointError):
            return cause
        return ParticipantUnavailable(f"{what}: failed with {cause!r}"[:500])
    if isinstance(exc, CheckpointError):
        return exc
    return ParticipantUnavailable(f"{what}: {exc!r}"[:500])


def _actor_died(exc: BaseException) -> bool:
    """The actor is dead for good (not restarting, not briefly unreachable)."""
    from ray.exceptions import ActorDiedError

    return isinstance(exc, ActorDiedError)


async def _await_ref(ref: Any, what: str, died: Callable[[], None] | None = None) -> Any:
    import ray

    try:
        return await ref
    except asyncio.CancelledError:
        # A straggler past the deadline: stop the remote work, not only our wait.
        with contextlib.suppress(Exception):
            ray.cancel(ref)
        raise
    except Exception as exc:
        if died is not None and _actor_died(exc):
            died()
        raise _unwrap_ray_error(exc, what) from None


class RayHost:
    """A `ParticipantHost` actor: one actor method per control operation."""

    def __init__(
        self,
        member: Member,
        handle: Any,
        *,
        actor_name: str | None = None,
        named: bool = False,
    ) -> None:
        self.member = member
        self.handle = handle
        self.actor_name = actor_name or member.key
        # Found by its name (discovery prunes it once the name is gone); a
        # handle registered directly may be of an actor with no name.
        self.named = named
        self.gone = False

    def _died(self) -> None:
        self.gone = True

    @property
    def identity(self) -> str | None:
        """Which actor answers (`coordination.engine.baseline`): a relaunch under the
        same name is another actor.  Ray offers no public accessor on a
        handle; its ID is fixed for the actor's life, so this one private
        read stays here, in the one wrapper that owns Ray calls."""
        actor_id = getattr(self.handle, "_actor_id", None)
        return None if actor_id is None else str(actor_id.hex())

    async def call(self, op: str, body: Mapping[str, Any]) -> dict[str, Any]:
        ref = getattr(self.handle, op).remote(dict(body))
        reply: dict[str, Any] = await _await_ref(ref, f"{op} to {self.member.key}", self._died)
        return reply

    async def status(self) -> dict[str, Any]:
        reply: dict[str, Any] = await _await_ref(
            self.handle.status.remote(), f"status of {self.member.key}", self._died
        )
        return reply

    def describe(self) -> dict[str, Any]:
        return {"transport": "ray", "actor": self.actor_name}

    async def aclose(self) -> None:
        return None


class HttpHost:
    """An HTTP-only participant, reached over the reserved control pool."""

    def __init__(self, member: Member, client: ControlClient) -> None:
        self.member = member
        self.client = client
        # An HTTP server that does not answer may be restarting: never gone.
        self.gone = False

    async def call(self, op: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.client.call(op, body)

    async def status(self) -> dict[str, Any]:
        return await self.client.status()

    def describe(self) -> dict[str, Any]:
        return {"transport": "http", "url": self.client.base_url}

    async def aclose(self) -> None:
        await self.client.aclose()


class FakeHost:
    """In-process participant for unit tests, with faults on demand.

    Drives `target` (e.g. a real `ParticipantEngine` over a fake
    participant) directly.  `hang` ops never answer until cancelled, `fail`
    ops raise the given error, `dead` makes every call unavailable, and
    `delay` sleeps before answering; a `dead` host is also `gone` (its actor
    no longer exists, as Ray reports for a killed one).  Every call start, reply, failure and
    cancellation is appended to `log`, which tests may share across hosts.
    """

    def __init__(
        self,
        member: Member,
        target: ControlTarget | None = None,
        *,
        log: Log | None = None,
        reply: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self.member = member
        self.target = target
        # Which "process" this is: another FakeHost under the same key is a
        # relaunch (`coordination.engine.baseline.identity`).
        self.identity = uuid.uuid4().hex
        self.log: Log = log if log is not None else []
        self._reply = reply
        self.hang: set[str] = set()
        self.fail: dict[str, CheckpointError] = {}
        self.delay: dict[str, float] = {}
        self.dead = False
        self.calls: list[tuple[str, dict[str, Any]]] = []

    @property
    def gone(self) -> bool:
        return self.dead

    def _note(self, event: str, op: str) -> None:
        self.log.append((time.monotonic(), event, self.member.key, op))

    async def call(self, op: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append((op, dict(body)))
        self._note("call", op)
        try:
            if self.dead:
                raise ParticipantUnavailable(f"{self.member.key} is dead")
            if op in self.delay:
                await asyncio.sleep(self.delay[op])
            if op in self.hang:
                await asyncio.Event().wait()
            if op in self.fail:
                raise self.fail[op]
            if self.target is not None:
                reply = await self.target.handle(op, dict(body))
            elif self._reply is not None:
                reply = self._reply(op, dict(body))
            else:
                reply = {}
        except asyncio.CancelledError:
            self._note("cancelled", op)
            raise
        except CheckpointError:
            self._note("failed", op)
            raise
        self._note("reply", op)
        return reply

    async def status(self) -> dict[str, Any]:
        if self.dead:
            raise ParticipantUnavailable(f"{self.member.key} is dead")
        if self.target is not None:
            return self.target.status()
        return {"kind": self.member.kind, "instance": self.member.name, "phase": "idle"}

    def describe(self) -> dict[str, Any]:
        return {"transport": "fake"}

    async def aclose(self) -> None:
        return None


# --- controller-side pause targets -------------------------------------------


class RayPauseTarget:
    """A trainer or assembler actor; method names are configurable so existing
    methods (e.g. a collector's own pause/resume) can be registered as they are."""

    def __init__(
        self,
        role: str,
        handle: Any,
        *,
        pause_method: str = "pause",
        resume_method: str = "resume",
        pass_args: bool = True,
    ) -> None:
        self.role = role
        self.handle = handle
        self.pause_method = pause_method
        self.resume_method = resume_method
        # Methods written for another protocol may take no arguments.
        self.pass_args = pass_args

    async def pause(self, checkpoint_id: str, deadline_s: float) -> Any:
        method = getattr(self.handle, self.pause_method)
        ref = method.remote(checkpoint_id, deadline_s) if self.pass_args else method.remote()
        return await _await_ref(ref, f"{self.pause_method} of {self.role}")

    async def resume(self, checkpoint_id: str) -> Any:
        method = getattr(self.handle, self.resume_method)
        ref = method.remote(checkpoint_id) if self.pass_args else method.remote()
        return await _await_ref(ref, f"{self.resume_method} of {self.role}")


class FakePauseTarget:
    def __init__(self, role: str, *, log: Log | None = None) -> None:
        self.role = role
        self.log: Log = log if log is not None else []
        self.paused: str | None = None
        self.fail_pause: CheckpointError | None = None

    async def pause(self, checkpoint_id: str, deadline_s: float) -> Any:
        self.log.append((time.monotonic(), "pause", self.role, checkpoint_id))
        if self.fail_pause is not None:
            raise self.fail_pause
        self.paused = checkpoint_id
        return {"in_flight": 0}

    async def resume(self, checkpoint_id: str) -> Any:
        self.log.append((time.monotonic(), "resume", self.role, checkpoint_id))
        self.paused = None
        return {"resumed": True}
