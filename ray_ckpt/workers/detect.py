"""Refuse a server whose port is shared by several unmanaged processes.

A Gym server started with several workers (uvicorn's ``--workers``, a
NeMo Gym ``num_workers``) but without `ray_ckpt.workers` runs one controller
per process: a prepare would close admission in the one worker it reaches
while the others keep serving.  Such a server cannot be checkpointed, so it
is refused where it joins, at discovery (HTTP) or when a sidecar host first
reaches it, never half-paused.

The sign: the status of every controller names its process; a managed
multi-worker server answers every status from its one host (and says
`workers`).  Probing status over fresh connections, each may land on
another process; two different processes without `workers` is the refusal.
A single process can never be refused by it; an unmanaged one escapes only
if every probe lands on the same process.
"""

from __future__ import annotations

from typing import Any

from ray_ckpt.control.client import ControlClient
from ray_ckpt.errors import InvalidRequest

# Status probes over fresh connections, beyond the first status.  Measured
# on 2 loaded cores against two processes on one port: in 60 series of 13
# probes, 3 had 12 land on the same process, so 13 let about one series in
# a hundred through; 24 take some 0.1 s at discovery and make that rare.
PROCESS_PROBES = 24


class UnmanagedWorkers(InvalidRequest):
    """The server answers from several processes, each its own controller."""


async def refuse_unmanaged_workers(
    client: ControlClient, first: dict[str, Any], *, probes: int = PROCESS_PROBES, what: str = ""
) -> None:
    """Raise `UnmanagedWorkers` if status answers name two processes."""
    if "workers" in first:
        return  # one host answers for all its workers
    seen = {first.get("process")}
    for _ in range(probes):
        status = await client.status_fresh()
        if "workers" in status:
            return
        seen.add(status.get("process"))
        named = sorted(p for p in seen if isinstance(p, str))
        if len(named) > 1:
            raise UnmanagedWorkers(
                f"{what or client.base_url} runs several worker processes, each with its "
                f"own checkpoint controller (seen {named}): a prepare would pause one "
                "worker while the others serve.  Run it under one ParticipantHost with "
                "workers=N (ray_ckpt.workers), or with one worker."
            )
