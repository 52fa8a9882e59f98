"""Where a Gym server runs and how its participant is reached.

- `spec` — `ServerSpec` (what a host is built from), the `GymServer`
  protocol, factory loading, actor names;
- `host` — the `ParticipantHost` Ray actor (hosted and sidecar modes) and
  `start_host` / `stop_host`, and `relaunch_host` (a fresh host under a dead
  one's name, for crash recovery);
- `sidecar` — the integration installed into a Gym server that runs as its
  own process, and the host side that forwards control calls to it.

`ray_ckpt.hosting.host` imports Ray; import it where a host is started.
"""
