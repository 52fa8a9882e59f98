"""The engine side of a rollout: run episodes against an environment server.

```python
async with data_session(64, 64) as session:
    tasks = make_tasks(4, steps=3, seed=7)
    reply = await run_episode(session, env_url, EpisodeId("r0"), tasks[0])
    digest = result_digest(reply["result"])
```

`run_episode` retries a `/run` refused with `admission_closed` (a checkpoint
is open) until admission reopens; any other refusal raises its typed error.
An episode's result never names its attempt or timing, so the digest of a
continued episode equals the digest of an uninterrupted run of the same task.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import aiohttp
import orjson

from ray_ckpt.errors import AdmissionClosed, ParticipantUnavailable, error_from_body
from ray_ckpt.identity import EpisodeId


async def run_episode(
    session: aiohttp.ClientSession,
    env_url: str,
    episode_id: EpisodeId,
    task: dict[str, Any],
    *,
    retry_s: float = 0.05,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """POST /run; the reply (`result` or `failure`), retrying `admission_closed`."""
    body = orjson.dumps(
        {
            "episode_id": {"rollout_id": episode_id.rollout_id, "attempt": episode_id.attempt},
            "task": task,
        }
    )
    url = env_url.rstrip("/") + "/run"
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                async with session.post(
                    url, data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    status, raw = resp.status, await resp.read()
            except aiohttp.ClientError as exc:
                raise ParticipantUnavailable(f"/run of {episode_id} failed: {exc!r}") from None
            reply = orjson.loads(raw) if raw else None
            if status < 400 and isinstance(reply, dict):
                return reply
            error = error_from_body(status, reply)
            if not isinstance(error, AdmissionClosed):
                raise error
            await asyncio.sleep(retry_s)


def make_tasks(n: int, steps: int, seed: int) -> list[dict[str, Any]]:
    """`n` tasks of `steps` steps each, seeds derived from `seed`."""
    return [
        {"task_id": f"task-{seed}-{i}", "seed": seed * 1000 + i, "steps": steps} for i in range(n)
    ]


def result_digest(result: Any) -> str:
    """Key-order-independent digest of an episode result."""
    return hashlib.sha256(orjson.dumps(result, option=orjson.OPT_SORT_KEYS)).hexdigest()
