"""A training loop that checkpoints its Gym fleet while rollouts are in flight.

The shape of a NeMo RL-style integration: a rollout collector (the trajectory
assembler) dispatches episodes to the environment server, a trainer consumes
them, and every few training steps the loop checkpoints Gym through the
coordinator:

1. `aprepare()` pauses the trainer and the collector (registered with the
   coordinator) and parks every Gym server at a boundary;
2. the episodes still in flight are the commit scope; `acommit(dir, scope)`
   writes the Gym part of the checkpoint (Gym manifest last);
3. the loop publishes its own checkpoint (here: a JSON file), then `aresume()`.

Run it on an embedded local Ray:  python examples/training_loop.py
or on a running cluster:          python examples/training_loop.py --address auto
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import uuid
from typing import Any

import ray

from coordination import aconnect
from participants.fleet import FleetConfig, launch_fleet
from participants.rollout import make_tasks, run_episode
from ray_ckpt import EpisodeId, data_session


@ray.remote(num_cpus=0)
class Collector:
    """Dispatches episodes; stops dispatching while a checkpoint is open."""

    def __init__(self, env_url: str, tasks: list[dict[str, Any]]) -> None:
        self.env_url = env_url
        self.queue = list(enumerate(tasks))
        self.in_flight: dict[str, asyncio.Task[None]] = {}
        self.done: dict[str, Any] = {}
        self.open = asyncio.Event()
        self.open.set()
        self.pump = asyncio.get_event_loop().create_task(self._pump())

    async def _pump(self) -> None:
        async with data_session(256, 256) as session:
            while self.queue or self.in_flight:
                await self.open.wait()
                while self.queue and len(self.in_flight) < 4 and self.open.is_set():
                    i, task = self.queue.pop(0)
                    rollout = f"rollout-{i}"
                    run = self._run(session, rollout, task)
                    self.in_flight[rollout] = asyncio.ensure_future(run)
                await asyncio.sleep(0.05)

    async def _run(self, session: Any, rollout: str, task: dict[str, Any]) -> None:
        reply = await run_episode(session, self.env_url, EpisodeId(rollout), task)
        self.done[rollout] = reply.get("result")
        del self.in_flight[rollout]

    # The pause contract the coordinator calls (idempotent).
    async def pause(self, checkpoint_id: str, deadline_s: float) -> dict[str, Any]:
        self.open.clear()
        return {"paused": True, "in_flight": len(self.in_flight)}

    async def resume(self, checkpoint_id: str) -> dict[str, Any]:
        self.open.set()
        return {"resumed": True}

    async def in_flight_episodes(self) -> list[str]:
        return sorted(self.in_flight)

    async def finished(self) -> int:
        return len(self.done)


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self) -> None:
        self.steps = 0
        self.paused = False
        self.log: list[str] = []

    async def pause(self, checkpoint_id: str, deadline_s: float) -> dict[str, Any]:
        self.paused = True
        self.log.append(f"pause {checkpoint_id}")
        return {"paused": True}

    async def resume(self, checkpoint_id: str) -> dict[str, Any]:
        self.paused = False
        self.log.append(f"resume {checkpoint_id}")
        return {"resumed": True}

    async def step(self) -> int:
        if not self.paused:
            self.steps += 1
        return self.steps

    async def history(self) -> list[str]:
        return self.log


async def train(namespace: str, out_dir: str, rollouts: int, checkpoints: int) -> dict[str, Any]:
    gym = await aconnect(namespace=namespace)
    fleet = await launch_fleet(
        FleetConfig(namespace=namespace, token=uuid.uuid4().hex, token_delay_s=0.02,
                    step_delay_s=0.05)
    )  # fmt: skip
    trainer = Trainer.remote()  # type: ignore[attr-defined]
    collector = Collector.remote(  # type: ignore[attr-defined]
        fleet.urls["environment"], make_tasks(rollouts, steps=3, seed=1)
    )
    try:
        await gym.adiscover()
        await gym.aregister_trainer(trainer)
        await gym.aregister_assembler(collector)
        published = []
        for n in range(checkpoints):
            await asyncio.sleep(1.0)
            await trainer.step.remote()
            prepared = await gym.aprepare()
            scope = await collector.in_flight_episodes.remote()
            ckpt = os.path.join(out_dir, f"step-{n}")
            committed = await gym.acommit(ckpt, scope)
            with open(os.path.join(ckpt, "trainer.json"), "w") as f:  # the loop's own state
                json.dump({"step": n, "gym": committed.checkpoint_id}, f)
            await gym.aresume()
            published.append(
                {"dir": ckpt, "episodes": len(scope), "prepare_s": prepared.seconds,
                 "commit_s": committed.seconds, "bytes": sum(committed.bytes.values())}
            )  # fmt: skip
        while await collector.finished.remote() < rollouts:
            await asyncio.sleep(0.2)
        return {"checkpoints": published, "trainer": await trainer.history.remote()}
    finally:
        ray.kill(collector)
        ray.kill(trainer)
        ray.kill(gym.actor, no_restart=True)
        await fleet.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--address", default=None, help='Ray address, e.g. "auto" (default: start a local Ray)'
    )
    parser.add_argument(
        "--rollouts", type=int, default=8, help="episodes the collector runs (default: 8)"
    )
    parser.add_argument(
        "--checkpoints", type=int, default=2, help="checkpoints taken, 1 s apart (default: 2)"
    )
    args = parser.parse_args()
    namespace = f"example-{uuid.uuid4().hex[:6]}"
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if args.address:
        ray.init(address=args.address, namespace=namespace)
    else:
        ray.init(num_cpus=2, include_dashboard=False, namespace=namespace,
                 _temp_dir=tempfile.mkdtemp(prefix="rce", dir="/tmp"))  # fmt: skip
    try:
        out = asyncio.run(train(namespace, tempfile.mkdtemp(), args.rollouts, args.checkpoints))
    finally:
        ray.shutdown()
    for c in out["checkpoints"]:
        print(f"{c['dir']}: {c['episodes']} episodes in flight, prepare {c['prepare_s']:.3f}s, "
              f"commit {c['commit_s']:.3f}s, {c['bytes']} bytes")  # fmt: skip
    print("trainer saw:", ", ".join(out["trainer"]))


if __name__ == "__main__":
    main()
