"""The main job: the reference fleet checkpointed mid-rollout, killed, restored.

- `app` — the `ray-ckpt` console script: the library's commands plus `demo`;
- `run` — `ray-ckpt demo` (the command, the run, its `--json` line);
- `options` — what a run is asked to do and the fleet that implies;
- `scenario` — the rollout driver, crash and restore-and-continue steps it,
  `preempt` and the end-to-end tests share;
- `report` — progress bars and the result tables;
- `nodes` — the embedded Ray it starts: one node, or `--nodes N` with
  `--kill-node`;
- `preempt` — `--until-signal` and `--resume latest` (`run` hands them over;
  `preempt` imports none of it).
- `partition` — `--nodes 3 --partition`: a node cut off in a network
  namespace, declared dead, healed, its zombie fenced (on `netbed`, the test
  bed it shares with tests/partitions).
- `sandbox` — `--sandbox`: the reference coding environment's episodes, whose
  state is a sandbox each (one with a live background process), crashed
  and continued; their files and rewards compared.

`python -m coordination.demo` runs it too (e.g. under `ray job submit`).
"""

from coordination.demo.options import DemoOptions
from coordination.demo.run import demo_command_main, run_demo

__all__ = ["DemoOptions", "demo_command_main", "run_demo"]
