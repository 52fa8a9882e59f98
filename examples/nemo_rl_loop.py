"""A GRPO-style loop (NeMo RL's async shape) that checkpoints its Gym servers.

The actors have the method signatures of NeMo RL's async GRPO pieces
(`nemo_rl/algorithms/async_utils.py`): an `AsyncTrajectoryCollector` that
collects rollouts in a background thread into a `ReplayBuffer`, paused and
resumed by argument-less `pause()` / `resume()`, and told the policy's weight
version after each step.  Here they are small stand-ins that play a Gym
resources server over HTTP instead of generating with a model; the wiring
to ray-ckpt is what a real loop adds:

    gym = connect(namespace=...)                  # the coordinator
    start_host(spec, namespace=...)               # each Gym server, a Ray actor
    gym.register_actor("resources", name)
    gym.register_assembler(collector)             # its own pause()/resume(), as is
    ...
    result = gym.checkpoint(f"{root}/step_{step}")  # between training steps

`checkpoint` pauses the collector (rollouts already running keep going: the
Gym server admits their calls once the checkpoint resumes), parks the Gym
server's sessions, writes them, writes the Gym manifest, resumes the server
and then the collector.  After a crash, `gym.restore(dir, rollouts)` puts
those sessions back under their next attempts (see
`docs/bring-your-own-server.md`).

The Gym server is the reference guessing-game resources server; to host a
real NeMo Gym server instead, use the spec in the guide
(``factory="participants.nemo_gym:hosted"``).

    python examples/nemo_rl_loop.py                    # an embedded local Ray
    python examples/nemo_rl_loop.py --address auto     # a running cluster
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import threading
import time
import uuid
from typing import Any

import aiohttp
import ray
from pydantic import SecretStr

from coordination import connect
from ray_ckpt.gym_server.spec import ServerSpec, settings_dict
from ray_ckpt.hosting.host import start_host, stop_host
from ray_ckpt.settings import CheckpointSettings

TOKEN = "nemo-rl-example-token"


class ReplayBuffer:
    """NeMo RL's `ReplayBuffer` methods: push, sample, size."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self.trajectories: list[tuple[dict[str, Any], int, int]] = []

    def push(self, trajectory: dict[str, Any], step: int, weight_version: int) -> None:
        self.trajectories.append((trajectory, step, weight_version))
        del self.trajectories[: -self.max_size]

    def sample(
        self, batch_size: int, current_weight_version: int, max_age_steps: int
    ) -> list[dict[str, Any]] | None:
        fresh = [t for t, _, v in self.trajectories if current_weight_version - v <= max_age_steps]
        if len(fresh) < batch_size:
            return None
        picked = fresh[:batch_size]
        self.trajectories = [e for e in self.trajectories if e[0] not in picked]
        return picked

    def size(self) -> int:
        return len(self.trajectories)


class AsyncTrajectoryCollector:
    """NeMo RL's collector methods; rollouts are games against a Gym server."""

    def __init__(
        self,
        policy_generation: Any,
        tokenizer: Any,
        task_to_env: dict[str, Any],
        master_config: dict[str, Any],
        replay_buffer: Any,
        start_step: int = 0,
    ) -> None:
        self.env_url: str = task_to_env["guess"]
        self.master_config = master_config
        self.replay_buffer = replay_buffer
        self.current_step = start_step
        self.current_weight_version = start_step
        self.running = False
        self.resumed = threading.Event()  # cleared while paused
        self.resumed.set()
        self.history: list[str] = []  # pause/resume calls, for the demo's report

    def set_weight_version(self, version: int) -> None:
        self.current_weight_version = version

    def get_weight_version(self) -> int:
        return self.current_weight_version

    def get_current_step(self) -> int:
        return self.current_step

    def start_collection(self, dataloader: list[list[dict[str, Any]]]) -> None:
        self.running = True
        self.thread = threading.Thread(target=asyncio.run, args=(self._collect(dataloader),))
        self.thread.daemon = True
        self.thread.start()

    def pause(self) -> None:
        self.resumed.clear()
        self.history.append("pause")

    def resume(self) -> None:
        self.history.append("resume")
        self.resumed.set()

    def stop(self) -> None:
        self.running = False
        self.resumed.set()

    def get_history(self) -> list[str]:
        return list(self.history)

    async def _collect(self, dataloader: list[list[dict[str, Any]]]) -> None:
        async with aiohttp.ClientSession() as http:
            for batch in dataloader:
                # As NeMo RL's loop: no new batch while paused; running games go on.
                await asyncio.to_thread(self.resumed.wait)
                if not self.running:
                    return
                version = self.current_weight_version
                games = [self._game(http, task) for task in batch]
                rewards = await asyncio.gather(*games)
                trajectory = {"rewards": rewards, "tasks": [t["rollout"] for t in batch]}
                self.replay_buffer.push.remote(trajectory, self.current_step, version)
                self.current_step += 1

    async def _game(self, http: aiohttp.ClientSession, task: dict[str, Any]) -> float:
        base = f"{self.env_url}/ng-rollout/{task['rollout']}"
        seed = {"task_id": task["rollout"], "seed": task["seed"]}
        async with http.post(f"{base}/seed_session", json=seed) as resp:
            resp.raise_for_status()
        low, high = 0, 99
        for _ in range(self.master_config["max_rollout_turns"]):
            guess = (low + high) // 2
            async with http.post(f"{base}/guess", json={"value": guess}) as resp:
                feedback = (await resp.json())["feedback"]
            if feedback == "correct":
                break
            low, high = (guess + 1, high) if feedback == "higher" else (low, guess - 1)
        async with http.post(f"{base}/verify", json={}) as resp:
            reward = float((await resp.json())["reward"])
        async with http.post(f"{base}/close_session", json={}):
            pass
        return reward


class Policy:
    """Stands in for the trainer: `train(data)` returns its metrics."""

    def __init__(self) -> None:
        self.steps = 0

    def train(self, data: list[dict[str, Any]]) -> dict[str, float]:
        self.steps += 1
        rewards = [r for t in data for r in t["rewards"]]
        return {"loss": 1.0 - sum(rewards) / max(len(rewards), 1), "step": float(self.steps)}


def gym_server_spec(name: str) -> ServerSpec:
    settings = CheckpointSettings(enabled=True, control_auth_token=SecretStr(TOKEN))
    return ServerSpec(
        kind="resources",
        name=name,
        factory="participants.servers.resources:resources_server",
        # Each guess takes a moment, so checkpoints land while games are in flight.
        options={"mode": "exported", "step_delay_s": 0.05},
        settings=settings_dict(settings),
    )


def dataloader(batches: int, per_batch: int, seed: int) -> list[list[dict[str, Any]]]:
    rng = random.Random(seed)
    return [
        [{"rollout": f"b{b}-p{p}", "seed": rng.randrange(10**6)} for p in range(per_batch)]
        for b in range(batches)
    ]


def run(
    namespace: str, checkpoint_root: str, *, steps: int = 4, every: int = 2, seed: int = 0
) -> dict[str, Any]:
    """The loop; returns what happened (the demo prints it, the test checks it)."""
    gym = connect(namespace=namespace, state_dir=f"{checkpoint_root}/coordinator")
    spec = gym_server_spec("guess")
    host = start_host(spec, namespace=namespace)
    env_url = ray.get(host.ready.remote())["url"]
    gym.register_actor(spec.kind, spec.name)
    actor: Any = ray.remote(num_cpus=0)
    buffer: Any = actor(ReplayBuffer).remote(max_size=64)
    config = {"max_rollout_turns": 8, "batch_size": 1, "max_age_steps": 2}
    collector: Any = actor(AsyncTrajectoryCollector).remote(
        None, None, {"guess": env_url}, config, buffer
    )
    policy: Any = actor(Policy).remote()
    # NeMo RL's collector pauses and resumes without arguments: registered as is.
    gym.register_assembler(collector)
    collector.start_collection.remote(dataloader(steps + 2, 3, seed))
    report: dict[str, Any] = {"metrics": [], "checkpoints": []}
    version = 0
    try:
        for step in range(steps):
            while (batch := ray.get(buffer.sample.remote(1, version, 2))) is None:
                time.sleep(0.05)
            report["metrics"].append(ray.get(policy.train.remote(batch)))
            version += 1
            ray.get(collector.set_weight_version.remote(version))
            if (step + 1) % every == 0:
                result = gym.checkpoint(f"{checkpoint_root}/step_{step + 1}")
                report["checkpoints"].append(
                    {"dir": result.checkpoint_dir, "continued": result.continued}
                )
        report["collector"] = ray.get(collector.get_history.remote())
    finally:
        ray.get(collector.stop.remote())
        asyncio.run(stop_host(host, timeout_s=10))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--address", default=None, help="Ray address (default: start one)")
    parser.add_argument(
        "--steps", type=int, default=4, help="training steps; a checkpoint every 2 (default: 4)"
    )
    args = parser.parse_args()
    namespace = f"nemo-rl-example-{uuid.uuid4().hex[:6]}"
    ray.init(address=args.address, namespace=namespace, log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="nemo-rl-loop-") as root:
        report = run(namespace, root, steps=args.steps)
    for i, metrics in enumerate(report["metrics"], 1):
        print(f"step {i}: loss {metrics['loss']:.3f}")
    for ckpt in report["checkpoints"]:
        print(f"checkpoint {ckpt['dir']}: {len(ckpt['continued'])} episodes in flight")
    print("collector saw: " + ", ".join(report["collector"]))


if __name__ == "__main__":
    main()
