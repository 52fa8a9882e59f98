"""The control plane one Gym server runs: everything a control call touches.

- `phase_machine` — the pure phase machine: transitions, fencing (stale →
  conflict → phase), the replay cache, lease arithmetic;
- `controller` — `ParticipantController`, which carries out what the machine
  decides (readiness waits, commit and restore through the storage seam);
- `shielded` — commit's and restore's order of steps, whose work outlives
  the call; `commit` and `restore` — that work;
- `protocol` — the `Participant` hooks one kind of server implements;
- `wire` — msgspec request and reply bodies;
- `routes` — the aiohttp control routes and the ASGI front;
- `client` — the control client and its reserved connection pool;
- `admission` — the gate closed from prepare to resume;
- `retire_marks` — per-rollout refusal marks raised by retire.
"""
