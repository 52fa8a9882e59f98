"""Every Python snippet of the README, run as written against the shared Ray
cluster and a real reference fleet, so the docs cannot drift from the code.

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
thread (signal handlers can only be installed there)."""

from __future__ import annotations

import asyncio
import pathlib
import re
import textwrap
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from participants.fleet import FleetConfig
from participants.rollout import make_tasks
from ray_ckpt.identity import EpisodeId
from tests.e2e.conftest import E2E

pytestmark = [pytest.mark.ray]

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
CRASH = re.compile(r"^# After a crash.*$|^\.\.\.$", re.M)
IN_FLIGHT = [EpisodeId("r0"), EpisodeId("r1")]


def snippets() -> list[str]:
    return [textwrap.dedent(b) for b in BLOCK.findall(README.read_text())]


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


def run(code: str, scope: dict[str, Any], crash: Callable[[], None]) -> None:
    """Run a snippet's parts in order, crashing the Gym where it says one happened."""
    parts = CRASH.split(code)
    for i, part in enumerate(parts):
        if i:
            crash()
        exec(compile(part, "README.md", "exec"), scope)  # the README's own code


def test_every_readme_snippet_runs(e2e: E2E, tmp_path: pathlib.Path) -> None:
    import ray

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

    scope: dict[str, Any] = {
        "trainer_actor": trainer,
        "collector_actor": collector,
        "collector": collector,
        "collector_in_flight_episodes": lambda: list(IN_FLIGHT),
        "publish_trainer_checkpoint": published.append,
        "step": 100,
        "episode_ids": list(IN_FLIGHT),
        "config": config,
        "post_run": post_run,
        "episode": EpisodeId("readme-r9"),
        "store": SimpleNamespace(commit=stored.append),
    }

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

    texts = snippets()
    assert len(texts) >= 5
    try:
        for index, text in enumerate(texts):
            code = localised(text, tmp_path, e2e.namespace)
            scope["_code"] = code
            if index == 1:
                scope["step"] = 101  # the asynchronous one writes a checkpoint of its own
            if code.lstrip().startswith("gym.restore"):
                crash()  # a snippet that only restores: into fresh processes
            run(code, scope, crash)
    finally:
        gym = scope.get("gym")
        if gym is not None:
            gym.stop_checkpoint_on_signal()
            gym.stop_periodic()
            gym.stop_drain_watch()
            e2e.coordinators.append(gym)
    # What the snippets promise, briefly: the trainer and collector were paused
    # and resumed, the reader's checkpoints were published, the async one is
    # durable, and the periodic loop's latest checkpoint was restored.
    assert published == [100, 101]
    assert len(stored) == 1, "the receipts snippet stored its one result once"
    assert ray.get(trainer.log.remote())[:2] == ["pause", "resume"]
    assert (tmp_path / "ckpt" / "step-100" / "gym" / "_manifest.json").exists()
    assert (tmp_path / "ckpt" / "step-101" / "gym" / "_manifest.json").exists()
    assert scope["done"] is not None
    assert any(e.complete for e in scope["gym"].list_checkpoints(str(tmp_path / "run-7")))
