"""Where a Gym server runs and how its participant is reached.

- `spec` — `ServerSpec` (what a host is built from), the `GymServer`
  protocol, factory loading, actor names;
- `host` — the `ParticipantHost` Ray actor (hosted mode) and `start_host`
  (which starts a `SidecarHost` for a spec with a `url`) / `stop_host`, and
  `relaunch_host` (a fresh host under a dead one's name, for crash recovery);
- `sidecar` — the integration installed into a Gym server that runs as its
  own process, and `SidecarHost`, the actor that forwards control calls to it;
- `serving` — serving an aiohttp or ASGI app in the running loop;
- `metrics` — a host's Ray metrics (control calls, writes in flight, lease
  expiries).

`ray_ckpt.hosting.host` imports Ray; import it where a host is started.
"""
