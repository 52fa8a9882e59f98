"""The control plane one Gym server runs: everything a control call touches.

- `phase_machine` — the pure phase machine: transitions, fencing (stale →
  conflict → phase), the replay cache, lease arithmetic;
- `engine` — `ParticipantEngine`, which carries out what the machine
  decides: every operation's order of steps reads there;
- `commit` — the write-once export and its store write (`Commits`, `Write`);
  `capture` — an asynchronous commit's true copy of the exported states;
  `background` — an asynchronous commit's write, after the resume;
- `restore` — the one restore a process may take, and its install;
- `timing` — per-call deadlines, prepare's readiness wait, the lease watcher;
- `receipt_ops` — the finished results a participant holds, behind `ack`
  and `collect`;
- `protocol` — the `Participant` hooks one kind of server implements;
- `wire` — msgspec request and reply bodies (what a participant reports,
  `PrepareReport` and `Receipt`, is `ray_ckpt.reports`, below `steps` too);
- `routes` — the shared gate and the aiohttp control routes; `asgi` — the
  ASGI (e.g. FastAPI) front over the same gate;
- `client` — the control client and its reserved connection pool;
- `admission` — the gate closed from prepare to resume;
- `observer` — what a engine reports to its host's metrics.
"""
