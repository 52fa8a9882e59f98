"""Tool sandboxes as participant state: the provider contract (`provider`)
and the local provider that snapshots a directory (`directory`)."""
