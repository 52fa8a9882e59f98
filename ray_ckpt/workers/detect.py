"""Refuse a server whose port is shared by several unmanaged processes.

A Gym server started with several workers (uvicorn's ``--workers``, a
NeMo Gym ``num_workers``) but without `ray_ckpt.workers` runs one engine
per process: a prepare would close admission in the one worker it reaches
while the others keep serving.  Such a server cannot be checkpointed, so it
is refused where it joins, at discovery (HTTP) or when a sidecar host first
reaches it, never half-paused.

A managed multi-worker server answers every status from its one host (and
says `workers`).  Otherwise the server is asked which processes accept on
its port (`accepting_processes`, read from /proc by the server itself): two
or more is the refusal, and it is certain.  Where the server cannot tell
(not Linux, an older ray-ckpt), status is probed over fresh connections,
each of which may land on another process; two different processes named
is the refusal.  That is chance: on a loaded machine the kernel hands most
connections to the worker it wakes first, and measured on 2 loaded cores,
24 probes all landed on one of two workers now and then.
"""

from __future__ import annotations

from typing import Any

from ray_ckpt.control.client import ControlClient
from ray_ckpt.errors import InvalidRequest

# Status probes over fresh connections, beyond the first status, where the
# server cannot name its accepting processes.  Measured on 2 loaded cores
# against two processes on one port: in 60 series of 13 probes, 3 had 12
# land on the same process; 24 take some 0.1 s at discovery.
PROCESS_PROBES = 24


class UnmanagedWorkers(InvalidRequest):
    """The server answers from several processes, each its own engine."""


async def refuse_unmanaged_workers(
    client: ControlClient, first: dict[str, Any], *, probes: int = PROCESS_PROBES, what: str = ""
) -> None:
    """Raise `UnmanagedWorkers` if the server runs several unmanaged processes."""
    if "workers" in first:
        return  # one host answers for all its workers
    asked = await client.status_fresh(processes=True)
    if "workers" in asked:
        return
    accepting = asked.get("accepting_processes")
    if isinstance(accepting, list):
        if len(accepting) > 1:
            raise _refusal(what or client.base_url, [str(p) for p in accepting])
        return
    seen = {first.get("process"), asked.get("process")}
    for probe in range(probes + 1):
        named = sorted(p for p in seen if isinstance(p, str))
        if len(named) > 1:
            raise _refusal(what or client.base_url, named)
        if probe == probes:
            return
        status = await client.status_fresh()
        if "workers" in status:
            return
        seen.add(status.get("process"))


def _refusal(what: str, processes: list[str]) -> UnmanagedWorkers:
    return UnmanagedWorkers(
        f"{what} runs several worker processes, each with its own checkpoint "
        f"engine (seen {processes}): a prepare would pause one worker while "
        "the others serve.  Run it under one ParticipantHost with workers=N "
        "(ray_ckpt.workers), or with one worker."
    )
