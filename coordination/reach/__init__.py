"""How the engine reaches a participant: a Ray actor, the HTTP control
routes, or an in-process double (`hosts`), behind the engine's `host` protocols."""
