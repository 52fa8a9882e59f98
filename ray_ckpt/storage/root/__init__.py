"""The checkpoint root: the Gym manifest written last (`gym_manifest`), the
`LATEST` pointer (`pointer`), the checkpoints under a root (`catalog`) and
deleting old ones (`retention`).  The top room: it may import every room below.
"""
