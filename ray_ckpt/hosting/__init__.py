"""Where a Gym server runs and how its participant is reached.

- `host` — the `ParticipantHost` Ray actor (hosted mode) and `start_host`
  (which starts a `SidecarHost` for a spec with a `url`) / `stop_host`, and
  `relaunch_host` (a fresh host under a dead one's name, for crash recovery);
- `sidecar` — the integration installed into a Gym server that runs as its
  own process, and `SidecarHost`, the actor that forwards control calls to it;
- `metrics` — a host's Ray metrics (control calls, writes in flight, lease
  expiries).

What a host is built from (`ServerSpec`) and serving an app are
`ray_ckpt.gym_server`, below both the hosting and its worker processes
(`ray_ckpt.workers`, which the host starts and which never import it).
`ray_ckpt.hosting.host` imports Ray; import it where a host is started.
"""
