"""Restore a Gym fleet after a crash and continue every rollout it was running.

The path a trainer takes when its Gym servers die between two checkpoints:

1. rollouts run against the reference fleet (one Gym server of each kind);
2. with some in flight, the driver checkpoints the Gym: `aprepare()` parks
   every server at a boundary, the unfinished rollouts are the scope,
   `acommit(dir, scope)` writes them (the Gym manifest last);
3. a crash: every Gym server process is killed (`ray.kill`, no draining),
   and the driver's calls to them fail; `aresume()` closes the checkpoint
   the dead servers never resumed from;
4. a fresh fleet is launched under the same names, `arestore(dir, scope)`
   installs each rollout's state as its next attempt (attempt + 1), and the
   driver runs that attempt to the end: from the step the checkpoint held
   (`continued`), or from the start where no server held state (`restart`).

Run it on an embedded local Ray:  python examples/restore_after_crash.py
or on a running cluster:          python examples/restore_after_crash.py --address auto
The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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


async def run(namespace: str, checkpoint_dir: str, rollouts: int) -> dict[str, Any]:
    gym = await aconnect(namespace=namespace)
    config = FleetConfig(namespace=namespace, token=uuid.uuid4().hex, token_delay_s=0.02,
                         step_delay_s=0.1)  # fmt: skip
    fleet = await launch_fleet(config)
    tasks = {f"rollout-{i}": task for i, task in enumerate(make_tasks(rollouts, 4, seed=3))}
    results: dict[str, Any] = {}
    fresh = None
    try:
        await gym.adiscover()
        async with data_session(64, 64) as session:

            async def attempt(env_url: str, episode: EpisodeId) -> None:
                reply = await run_episode(session, env_url, episode, tasks[episode.rollout_id])
                results[episode.rollout_id] = reply.get("result")

            # 1. Rollouts, started a little apart so they are at different steps.
            running = {}
            for i, rollout in enumerate(tasks):
                episode = EpisodeId(rollout)
                running[rollout] = asyncio.ensure_future(
                    attempt(fleet.urls["environment"], episode)
                )
                await asyncio.sleep(0.3 if i else 0.0)
            await asyncio.sleep(0.5)

            # 2. The checkpoint: its scope is what is still running once the Gym is parked.
            await gym.aprepare()
            scope = [EpisodeId(r) for r, t in running.items() if not t.done()]
            committed = await gym.acommit(checkpoint_dir, scope)
            print(f"checkpoint {committed.checkpoint_id}: {len(scope)} rollouts in flight")

            # 3. The crash: the servers die; the driver's calls to them fail.
            fleet.kill()
            for task in running.values():
                task.cancel()
            for task in running.values():
                with contextlib.suppress(BaseException):
                    await task
            await gym.aresume()  # the dead servers' checkpoint is closed

            # 4. Fresh servers under the same names; restore; attempt + 1 of each.
            fresh = await launch_fleet(config)
            restored = await gym.arestore(checkpoint_dir, scope)
            print(f"restored in {restored.total_s:.3f}s: continued {sorted(restored.continued)}, "
                  f"restarted {sorted(restored.restart)}")  # fmt: skip
            for episode in scope:
                results.pop(episode.rollout_id, None)  # its crashed attempt's reply, if any
            await asyncio.gather(*(attempt(fresh.urls["environment"], e.next()) for e in scope))
        return {
            "rollouts": rollouts,
            "finished": sorted(r for r, result in results.items() if result is not None),
            "in_flight_at_checkpoint": sorted(e.rollout_id for e in scope),
            "continued": sorted(restored.continued),
            "restarted": sorted(restored.restart),
        }
    finally:
        for f in (fleet, fresh):
            if f is not None:
                f.kill()
        ray.kill(gym.actor, no_restart=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--address", default=None, help='Ray address, e.g. "auto" (default: start a local Ray)'
    )
    parser.add_argument("--rollouts", type=int, default=6, help="rollouts run (default: 6)")
    args = parser.parse_args()
    namespace = f"example-{uuid.uuid4().hex[:6]}"
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if args.address:
        ray.init(address=args.address, namespace=namespace)
    else:
        ray.init(num_cpus=2, include_dashboard=False, namespace=namespace,
                 _temp_dir=tempfile.mkdtemp(prefix="rce", dir="/tmp"))  # fmt: skip
    try:
        out = asyncio.run(run(namespace, tempfile.mkdtemp(prefix="ckpt-"), args.rollouts))
    finally:
        ray.shutdown()
    print(f"{len(out['finished'])} of {out['rollouts']} rollouts finished")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
