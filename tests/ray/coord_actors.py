"""Small test-only actors for the coordinator's real-Ray tests.

`RecordingHost` has the `ParticipantHost` methods over a real
`ParticipantEngine` (fake participant, real file storage) and records
when each call started and ended; `Controlled` is a trainer/assembler stand-in.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.settings import CheckpointSettings
from tests.unit.fakes import FakeParticipant


class RecordingHost:
    def __init__(
        self,
        kind: str,
        name: str,
        *,
        lease_grace_s: float = 600.0,
        delay: dict[str, float] | None = None,
        live: list[str] | None = None,
        fail_restore: bool = False,
    ) -> None:
        self.part = FakeParticipant(kind)
        for key in live or []:
            self.part.start(key, at_boundary=True, state={"key": key, "step": 2})
        settings = CheckpointSettings.model_validate(
            {"enabled": True, "control_auth_token": "t", "lease_grace_seconds": lease_grace_s}
        )
        self.ctrl = ParticipantEngine(self.part, instance=name, settings=settings)
        self.delay = delay or {}
        self.fail_restore = fail_restore
        self.calls: list[tuple[str, float, float, str]] = []
        self.cancelled: list[str] = []

    async def _op(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        self.ctrl.start()
        start = time.time()
        try:
            if op in self.delay:
                await asyncio.sleep(self.delay[op])
            if op == "restore" and self.fail_restore:
                from ray_ckpt.errors import InvalidCheckpointState

                raise InvalidCheckpointState("records digest mismatch (test)")
            return await self.ctrl.handle(op, body)
        except asyncio.CancelledError:
            self.cancelled.append(op)
            raise
        finally:
            self.calls.append((op, start, time.time(), str(body.get("checkpoint_id"))))

    async def prepare(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._op("prepare", body)

    async def renew(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._op("renew", body)

    async def commit(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._op("commit", body)

    async def restore(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._op("restore", body)

    async def resume(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._op("resume", body)

    async def retire(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._op("retire", body)

    async def forget(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._op("forget", body)

    async def status(self) -> dict[str, Any]:
        self.ctrl.start()
        return self.ctrl.status()

    async def log(self) -> dict[str, Any]:
        return {"calls": self.calls, "cancelled": self.cancelled, "restored": self.part.restored}


class Controlled:
    """A trainer or assembler: records pause/resume (idempotent)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, str]] = []

    async def pause(self, checkpoint_id: str, deadline_s: float) -> dict[str, int]:
        self.events.append(("pause", time.time(), checkpoint_id))
        return {"in_flight": 0}

    async def resume(self, checkpoint_id: str) -> dict[str, bool]:
        self.events.append(("resume", time.time(), checkpoint_id))
        return {"resumed": True}

    async def log(self) -> list[tuple[str, float, str]]:
        return self.events


def start_host(namespace: str, key: str, **kwargs: Any) -> Any:
    import ray

    kind, name = key.split("/")
    return (
        ray.remote(RecordingHost)
        .options(name=key, namespace=namespace, num_cpus=0, max_concurrency=100)
        .remote(kind, name, **kwargs)
    )


def start_controlled(namespace: str) -> Any:
    import ray

    return ray.remote(Controlled).options(namespace=namespace, num_cpus=0).remote()
