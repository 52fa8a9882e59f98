"""The restart bias combines what each participant says of an episode: the
environment its steps, the model its tokens; a restore counts both, per bucket."""

from __future__ import annotations

import pathlib

from coordination.engine.timeline import StorageHistory
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.root.history import Progress, read_timeline
from tests.unit.coordination.coord_fleet import make_fleet

# rollout → (steps done, tokens generated) when checkpointed
DONE = {"r1": (4, 30), "r2": (12, 100), "r3": (0, 5)}


async def test_steps_from_the_environment_and_tokens_from_the_model_combine(
    tmp_path: pathlib.Path,
) -> None:
    directory = str(tmp_path / "step-1")
    fleet = make_fleet()
    fleet.core.history = StorageHistory()
    for rollout, (steps, tokens) in DONE.items():
        fleet.parts["environment/env"].start(rollout, at_boundary=True, state={"step": steps})
        fleet.parts["model/policy"].start(
            rollout, at_boundary=True, state={"rows": [], "progress": {"tokens": tokens}}
        )
        # The agent and resources say nothing: they take nothing away.
        fleet.parts["agent/agent"].start(rollout, at_boundary=True, state={"s": 1})
    try:
        await fleet.core.checkpoint(directory, [EpisodeId(r) for r in DONE])
    finally:
        await fleet.aclose()
    saved = read_timeline(directory)
    assert saved is not None
    assert saved.progress == {r: Progress(steps=s, tokens=t) for r, (s, t) in DONE.items()}

    fresh = make_fleet(store=fleet.store)
    fresh.core.history = StorageHistory()
    try:
        # r1 and r3 continue, r9 starts over (never checkpointed), r2 is lost.
        res = await fresh.core.restore(directory, [EpisodeId(r) for r in ("r1", "r3", "r9")])
    finally:
        await fresh.aclose()
    bias = res.restart_bias
    assert bias is not None
    assert bias.tokens == {"continued": 35, "lost": 100}
    # Per bucket (by steps), where some participant said: r9 is in "unknown"
    # with no token count, so that bucket says none.
    assert bias.tokens_table() == {
        "0": {"continued": 5},
        "3-5": {"continued": 30},
        "11+": {"lost": 100},
    }
    assert bias.as_table()["unknown"] == {"continued": 0, "restarted": 1, "lost": 0}


async def test_a_stop_checkpoint_kept_open_has_its_timeline_saved(tmp_path: pathlib.Path) -> None:
    """A `stop` checkpoint is a preemption's last: kept open (nobody resumes
    it), its process exits next; a restore from it still counts its bias."""
    directory = str(tmp_path / "c")
    fleet = make_fleet()
    fleet.core.history = StorageHistory()
    fleet.parts["environment/env"].start("r1", at_boundary=True, state={"step": 3})
    fleet.parts["environment/env"].start("r2", at_boundary=True, state={"step": 7})
    scope = [EpisodeId("r1"), EpisodeId("r2")]
    try:
        await fleet.core.checkpoint(directory, scope, stop=True, resume=False)
        assert fleet.core.open is not None  # still open: no close will save it
        saved = read_timeline(directory)
    finally:
        await fleet.aclose()
    assert saved is not None
    assert (saved.outcome, sorted(saved.continued)) == ("ok", ["r1", "r2"])
    fresh = make_fleet(store=fleet.store)
    fresh.core.history = StorageHistory()
    try:
        res = await fresh.core.restore(directory, [EpisodeId("r1")])
    finally:
        await fresh.aclose()
    assert res.restart_bias is not None
    assert res.restart_bias.known
    assert res.restart_bias.as_table()["3-5"]["continued"] == 1
    assert res.restart_bias.as_table()["6-10"]["lost"] == 1
