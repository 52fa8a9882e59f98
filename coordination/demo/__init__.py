"""The main job: the reference fleet checkpointed mid-rollout, killed, restored.

- `run` — `ray-ckpt demo` (options, the run, its `--json` line);
- `scenario` — the rollout driver, crash and restore-and-continue steps it and
  the end-to-end tests share;
- `report` — progress bars and the result tables;
- `nodes` — the embedded Ray it starts: one node, or `--nodes N` with
  `--kill-node`;
- `preempt` — `--until-signal` and `--resume latest`.

`python -m coordination.demo` runs it too (e.g. under `ray job submit`).
"""

from coordination.demo.run import DemoOptions, demo_command_main, run_demo

__all__ = ["DemoOptions", "demo_command_main", "run_demo"]
