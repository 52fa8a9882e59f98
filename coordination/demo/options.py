"""What one `ray-ckpt demo` run is asked to do, and the fleet that implies.

`DemoOptions` holds the command's options; `fleet_config` turns them into the
reference fleet's `FleetConfig`.  The main run (`run`) and the preemption
story (`preempt`) both start from them, so neither imports the other for it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from participants.fleet import FleetConfig


@dataclass(frozen=True)
class DemoOptions:
    address: str | None
    namespace: str
    rollouts: int
    steps: int
    seed: int
    checkpoint_dir: str | None
    token_delay_s: float
    step_delay_s: float
    verify_delay_s: float
    stagger_s: float
    nodes: int = 1
    kill_node: bool = False
    until_signal: bool = False
    resume: str | None = None  # "latest"
    grace_s: float = 25.0
    timeline: str | None = None  # write the checkpoint's Chrome trace here
    durability: str = "sync"  # "async": resume once captured, then wait for durable
    # Completion receipts: the environment holds each result until the driver
    # acknowledges it; the driver loses the first `lose_replies` replies and
    # gets those results back by `collect()` after the restore.
    receipts: bool = True
    lose_replies: int = 2
    workers: int = 1  # worker processes per Gym server (ray_ckpt.workers)
    restore_workers: int | None = None  # the fresh fleet's count (default: workers)
    # Cut the environment's node off the network mid-flight (coordination/demo/partition.py).
    partition: bool = False
    # Coding episodes in sandboxes, one with a live background process
    # (coordination/demo/sandbox.py).
    sandbox: bool = False


def fleet_config(
    opts: DemoOptions, *, suffix: str, namespace: str, receipts: bool = False
) -> FleetConfig:
    return FleetConfig(
        namespace=namespace,
        token=uuid.uuid4().hex,
        token_delay_s=opts.token_delay_s,
        step_delay_s=opts.step_delay_s,
        verify_delay_s=opts.verify_delay_s,
        tokens_per_turn=8,
        turns_per_step=2,
        model_seed=opts.seed,
        suffix=suffix,
        completion_receipts=receipts,
        workers=opts.workers,
    )
