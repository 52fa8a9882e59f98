"""Starting one worker process, and reading its reports (the pool's helpers)."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from ray_ckpt.workers.config import WorkerConfig, encode_config
from ray_ckpt.workers.tracking import WorkerReport


def to_report(body: dict[str, Any]) -> WorkerReport:
    return WorkerReport(
        generation=int(body["generation"]),
        ready=bool(body["ready"]),
        live=int(body.get("live", 0)),
        fresh=bool(body.get("fresh", True)),
        retiring=int(body.get("retiring", 0)),
        blockers=tuple(body.get("blockers", ())),
        blocker_count=int(body.get("blocker_count", 0)),
        restarts=tuple(body.get("restarts", ())),
        held=int(body.get("held", -1)),
        held_bytes=int(body.get("held_bytes", 0)),
    )


def _child_env() -> dict[str, str]:
    """The host's environment, with its import path: a worker imports the
    server's factory exactly as the host would (a Ray actor's path may hold
    directories no environment variable names)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


async def spawn_worker(config: WorkerConfig) -> asyncio.subprocess.Process:
    """``python -m ray_ckpt.workers.worker`` with the shared socket inherited
    and its config on stdin (never on argv: the spec holds the token)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ray_ckpt.workers.worker",
        stdin=asyncio.subprocess.PIPE,
        pass_fds=(config.listen_fd,),
        env=_child_env(),
    )
    assert proc.stdin is not None
    proc.stdin.write(encode_config(config))
    proc.stdin.close()
    return proc
