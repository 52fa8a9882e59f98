"""The trainer's client: `connect` and the `CoordinatorHandle`, its calls
to the actor, and a pending asynchronous checkpoint."""
