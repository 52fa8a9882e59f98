"""A Gym server as ray-ckpt runs it, below everything that runs one.

- `spec` — `ServerSpec` (what a host is built from), the `GymServer`
  protocol, factory loading, actor names;
- `serving` — serving an aiohttp or ASGI app in the running loop.

`ray_ckpt.hosting` (the host actors) and `ray_ckpt.workers` (a host's worker
processes) both build on these; the hosting imports the workers, never the
other way round.
"""
