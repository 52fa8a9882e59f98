"""Multi-worker Gym servers: N worker processes under one `ParticipantHost`.

The host owns the one control plane (phase machine, fencing, lease, attempt
fence); its workers serve the data routes on one shared port and obey it over
a Unix socket (`frames`, `channel`).  Who reported at which close generation,
and what blocks a checkpoint, is the pure `tracking` table; which worker owns
a rollout is the pure `routing`.  `pool` runs the workers from the host,
`aggregate` is the participant the host's engine drives, `worker` is a
worker process's main, `front` its request spreading.
"""
