"""The policy model says how many tokens each exported episode had generated
(its delivered calls and the cut in flight), so a restore's restart bias can
count episodes by it; records written before it still install."""

from __future__ import annotations

from participants.policy_model import PolicyModelParticipant
from ray_ckpt.control.progress import progress_of
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.records.record import Record


def serve(model: PolicyModelParticipant, episode: EpisodeId, position: int, n: int) -> None:
    call = model.admit(episode, f"d-{episode.capture_key}-{position}", "p", position=position)
    call.tokens = list(range(n))
    model.deliver(call)
    model.delivered(call, {"call": call.index, "tokens": n})
    model.drop(call)


async def test_an_exported_episode_says_its_delivered_and_cut_tokens() -> None:
    model = PolicyModelParticipant()
    a, b, c = EpisodeId("a"), EpisodeId("b"), EpisodeId("c")
    serve(model, a, 0, 5)
    serve(model, a, 1, 3)
    serve(model, b, 0, 4)
    # a's third call is generating when the checkpoint closes: cut at 2 tokens.
    held = model.admit(a, "d-a-2", "p", position=2)
    held.tokens = [1, 2]
    # c's only row predates token counts: its total is unknown, not understated.
    model.ledger[c] = [{"call": 99}]
    model.close_admission()
    records = await model.export([a, b, c])
    assert progress_of(records) == {"a": {"tokens": 5 + 3 + 2}, "b": {"tokens": 4}}
    model.open_admission()
    model.drop(held)

    # Installed elsewhere (its progress is derived, not kept), and a record
    # written before the field existed installs as well.
    fresh = PolicyModelParticipant()
    old = Record("d", {"rows": [{"call": 0, "tokens": 6, "position": 0}], "cut": None})
    assert await fresh.install([*records, old]) == [
        EpisodeId("a", 1),
        EpisodeId("b", 1),
        EpisodeId("c", 1),
        EpisodeId("d", 1),
    ]
    again = await fresh.export([EpisodeId("a", 1), EpisodeId("d", 1)])
    assert progress_of(again) == {"a-a1": {"tokens": 10}, "d-a1": {"tokens": 6}}
