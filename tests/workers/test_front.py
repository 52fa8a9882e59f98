"""The worker front's peer table (pure: no process, no socket)."""

from __future__ import annotations

from ray_ckpt.gym_server.spec import ROLLOUT
from ray_ckpt.workers.front import WorkerFront


def test_an_older_peer_table_never_replaces_a_newer_one() -> None:
    """The hello reply's table may be applied after a newer broadcast was
    read: the older one must not make a live peer look down."""
    front = WorkerFront(index=1, workers=2, spreading=ROLLOUT, control_url=None)
    both = {0: "http://127.0.0.1:1001", 1: "http://127.0.0.1:1002"}
    assert front.set_peers(2, both)  # the broadcast after w0's hello
    assert not front.set_peers(1, {1: both[1]})  # w1's own, older hello reply
    assert front.peers == both
    # A loss is a newer version, and applies.
    assert front.set_peers(3, {1: both[1]})
    assert front.peers == {1: both[1]}
