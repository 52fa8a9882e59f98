"""Retire in the steps table: stop every covered attempt, wait for it, free it.

Apart from the table (`table.py`) because it is the one operation that owns
other tasks' lifetimes: it cancels each attempt's task once, keeps the
attempt a blocker (`retiring`) until the task has really stopped, and frees
it from the task's done callback, so a retire call that is itself cancelled
(a control deadline) still ends with nothing held.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ray_ckpt.identity import EpisodeId
from ray_ckpt.steps.episode import Episode
from ray_ckpt.steps.modes import EpisodeState
from ray_ckpt.steps.retire_marks import retire_scope

if TYPE_CHECKING:
    from ray_ckpt.steps.table import EpisodeSteps


async def retire_attempts(steps: EpisodeSteps, episode_ids: Sequence[EpisodeId]) -> list[str]:
    """Stop every attempt <= the given one of each rollout, wait, free.

    Each attempt's task is cancelled once (a second cancel would interrupt
    its cleanup) and awaited, so its `finally:` blocks have run when this
    returns.  If this call is itself cancelled (a control deadline), the
    attempts keep stopping and stay blockers in state `retiring` until
    they do; a later retire waits for them again.  Returns capture keys.
    """
    covered = retire_scope(episode_ids)

    keys = steps._restored.retire(covered, steps._live)
    me = asyncio.current_task()
    stopping: set[asyncio.Task[Any]] = set()
    for ep in [ep for eid, ep in steps._live.items() if covered(eid)]:
        keys.add(ep.key)
        if not steps.admission_open:
            steps._restored.retired(ep.id)
        task = ep.task
        if task is None or task.done() or task is me:
            steps._free(ep, completed=False)
            continue
        if not ep.retire_requested:
            ep.retire_requested = True
            steps._transition(ep, EpisodeState.RETIRING)
            # Freed when the task ends, even if this retire is cancelled first.
            task.add_done_callback(functools.partial(_stopped, steps, ep))
            task.cancel()
        stopping.add(task)
    if keys:
        steps._changed()
    if stopping:
        # asyncio.wait, not gather: cancelling us must not cancel them again.
        await asyncio.wait(stopping)
    return sorted(keys)


def _stopped(steps: EpisodeSteps, ep: Episode, _task: asyncio.Task[Any]) -> None:
    steps._free(ep, completed=False)
