"""Every Python snippet of the README and of every docs page, run as written
against the shared Ray cluster and a real reference fleet, so the docs cannot
drift from the code.  The pages run in order (README.md, then the site's nav:
`tests/doc_pages.py`), each in a scope of its own with a connected `gym`;
blocks marked `<!-- snippet: skip (why) -->` are not run.

What a snippet leaves to the reader is supplied, and nothing else changes:
the reader's own objects (a trainer and a collector actor, the collector's
in-flight episodes, `publish_trainer_checkpoint`, `step`, `config`, a
`post_run` of the environment's `/run` and a `store`), the
places (`/ckpt/...` and `s3://bucket/run-7` become directories under the
test's tmp dir, `rl-run-7` the test's namespace), and the crash a comment
announces ("After a crash, in fresh Gym processes", `...` between a periodic
loop and a restore of its latest) or a snippet that only restores implies:
there the test kills every Gym host and launches a fresh fleet, as a user
would.  `every_s=600` becomes 1 s so the
periodic loop writes a checkpoint to restore.  The snippets run in the main
thread (signal handlers can only be installed there).  `step` is 100 for the
first snippet and one more for each after it, so no two write the same
directory."""

from __future__ import annotations

import asyncio
import pathlib
import re
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from participants.fleet import FleetConfig
from participants.rollout import make_tasks
from ray_ckpt.identity import EpisodeId
from tests.doc_pages import pages, snippets
from tests.e2e.conftest import E2E

pytestmark = [pytest.mark.ray]

CRASH = re.compile(r"^# After a crash.*$|^\.\.\.$", re.M)
IN_FLIGHT = [EpisodeId("r0"), EpisodeId("r1")]


class Collector:
    """The reader's trajectory collector: pausable, and it knows its in-flight episodes."""

    def __init__(self) -> None:
        self.events: list[str] = []

    async def pause(self, *args: Any) -> dict[str, int]:
        self.events.append("pause")
        return {"in_flight": len(IN_FLIGHT)}

    async def resume(self, *args: Any) -> dict[str, bool]:
        self.events.append("resume")
        return {"resumed": True}

    async def in_flight_episodes(self) -> list[EpisodeId]:
        return list(IN_FLIGHT)

    async def log(self) -> list[str]:
        return self.events


def localised(code: str, tmp: pathlib.Path, namespace: str) -> str:
    return (
        code.replace('"/ckpt/', f'"{tmp}/ckpt/')
        .replace('"s3://bucket/run-7"', f'"{tmp}/run-7"')
        .replace('"rl-run-7"', f'"{namespace}"')
        .replace("every_s=600", "every_s=1")
    )


def run(code: str, name: str, scope: dict[str, Any], crash: Callable[[], None]) -> None:
    """Run a snippet's parts in order, crashing the Gym where it says one happened."""
    parts = CRASH.split(code)
    for i, part in enumerate(parts):
        if i:
            crash()
        exec(compile(part, name, "exec"), scope)  # the docs' own code


def test_every_docs_snippet_runs(e2e: E2E, tmp_path: pathlib.Path) -> None:
    import ray

    from coordination import connect

    config: FleetConfig = e2e.config(completion_receipts=True)
    asyncio.run(e2e.launch(config))
    actor = ray.remote(Collector).options(namespace=e2e.namespace, num_cpus=0)
    trainer, collector = actor.remote(), actor.remote()
    published: list[int] = []
    stored: list[Any] = []

    def post_run(episode: EpisodeId) -> dict[str, Any]:
        """The reader's own call of the environment's `/run`."""
        task = make_tasks(1, 1, seed=7)[0]
        body = {"episode_id": {"rollout_id": episode.rollout_id, "attempt": episode.attempt}}
        reply = httpx.post(
            f"{e2e.fleets[-1].urls['environment']}/run", json={**body, "task": task}, timeout=60
        )
        reply.raise_for_status()
        result: dict[str, Any] = reply.json()
        return result

    def reader(gym: Any) -> dict[str, Any]:
        """What a page leaves to its reader, fresh for each page."""
        return {
            "gym": gym,
            "trainer_actor": trainer,
            "collector_actor": collector,
            "collector": collector,
            "collector_in_flight_episodes": lambda: list(IN_FLIGHT),
            "publish_trainer_checkpoint": published.append,
            "episode_ids": list(IN_FLIGHT),
            "config": config,
            "post_run": post_run,
            "episode": EpisodeId("readme-r9"),
            "store": SimpleNamespace(commit=stored.append),
        }

    scope: dict[str, Any] = {}

    def crash() -> None:
        if "start_periodic" in scope["_code"]:
            # `...` stands for the run going on: let the loop complete a checkpoint.
            root = str(tmp_path / "run-7")
            deadline = time.monotonic() + 60
            while not any(e.complete for e in scope["gym"].list_checkpoints(root)):
                assert time.monotonic() < deadline, "the periodic loop wrote no checkpoint"
                time.sleep(0.2)
            # The loop goes on through the crash: it must not publish the
            # half-dead Gym, or the fresh one, as latest (MembershipChanged).
        e2e.fleets[-1].kill()
        asyncio.run(e2e.launch(config))

    gyms = [connect(namespace=e2e.namespace)]
    ran: list[str] = []
    try:
        for page in pages():
            runnable = [s for s in snippets(page) if not s.skip]
            if not runnable:
                continue
            scope = reader(gyms[0])
            for snippet in runnable:
                code = localised(snippet.code, tmp_path, e2e.namespace)
                scope["_code"] = code
                scope["step"] = 100 + len(ran)
                if code.lstrip().startswith("gym.restore"):
                    crash()  # a snippet that only restores: into fresh processes
                run(code, snippet.name, scope, crash)
                ran.append(snippet.name)
                if scope["gym"] not in gyms:
                    gyms.append(scope["gym"])
    finally:
        for gym in gyms:
            gym.stop_checkpoint_on_signal()
            gym.stop_periodic()
            gym.stop_drain_watch()
            e2e.coordinators.append(gym)
    # What the snippets promise, briefly: the README's own snippet ran first,
    # the trainer and collector were paused and resumed, every trainer
    # checkpoint published has its Gym part complete beside it, a result was
    # handed over by receipt once, and the periodic loop's root holds a
    # complete checkpoint.
    assert ran[0].startswith("README.md"), ran
    assert len(ran) >= 8, ran
    assert published
    assert published[0] == 100
    for step in published:
        assert (tmp_path / "ckpt" / f"step-{step}" / "gym" / "_manifest.json").exists(), step
    assert stored, "the receipts snippet stored no result"
    assert len({repr(r) for r in stored}) == len(stored), "a result was stored twice"
    assert ray.get(trainer.log.remote())[:2] == ["pause", "resume"]
    assert any(e.complete for e in gyms[0].list_checkpoints(str(tmp_path / "run-7")))
