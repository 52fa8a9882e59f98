"""The policy model's calls and generation cuts: `Call`, `Cut`, and their two rules.

A `Call` is one admitted generation, from admission to delivery; a `Cut` is
the prefix of an undelivered one at a token boundary.  The rules kept here
are the ones that decide what a checkpoint stages and what a restore
continues: at close, each episode's latest undelivered generation of a live
attempt is cut; after a restore, a re-issued call continues from the cut only
if it asks for the same generation (conversation digest and generation
parameters) and its limit fits the prefix.  The participant
(`participants.policy_model`) owns the tables and calls these.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from ray_ckpt.identity import EpisodeId


class Cut(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A generation cut at a token boundary: the prefix and what it belongs to."""

    digest: str  # the conversation the generation answers
    tokens: list[int]
    call: int  # admission index of the cut call (diagnostics only)
    # Digest of the generation-defining parameters of the cut call.  None (a
    # record written before it was kept) never matches: regenerating is safe,
    # continuing under other limits or sampling is not.
    params: str | None = None


class Call:
    """One admitted generation, from admission to delivery."""

    __slots__ = (
        "continued",
        "delivering",
        "digest",
        "episode",
        "finished",
        "index",
        "params",
        "position",
        "task",
        "tokens",
    )

    def __init__(
        self,
        episode: EpisodeId,
        digest: str,
        index: int,
        task: Any,
        *,
        params: str = "",
        position: int | None = None,
    ) -> None:
        self.episode = episode
        self.digest = digest
        self.params = params
        self.position = position  # the caller's call position, if it said
        self.index = index
        self.task: asyncio.Task[Any] | None = task
        self.tokens: list[int] = []
        self.continued = 0  # tokens taken from a restored cut
        self.delivering = False
        self.finished = False  # its attempt was closed, retired or forgotten meanwhile


def cut_generations(
    calls: Iterable[Call], retired: Callable[[EpisodeId], bool], counts: Counter[str]
) -> dict[EpisodeId, Cut]:
    """Each episode's latest undelivered generation of a live attempt, cut now."""
    latest: dict[EpisodeId, Call] = {}
    for call in calls:
        if call.delivering:
            continue  # delivered before the checkpoint: it goes to the ledger
        if call.finished or retired(call.episode):
            continue  # its attempt is gone: nothing of it is staged
        held = latest.get(call.episode)
        if held is None or call.index > held.index:
            latest[call.episode] = call
    cuts = {}
    for episode, call in latest.items():
        if not call.tokens:
            counts["cut_skipped"] += 1
            continue
        cuts[episode] = Cut(call.digest, list(call.tokens), call.index, call.params)
        counts["cut"] += 1
    return cuts


def continue_restored(
    call: Call, restored_cuts: dict[EpisodeId, Cut], limit: int | None, counts: Counter[str]
) -> None:
    """Start `call` from its attempt's restored cut if it asks for that generation."""
    cut = restored_cuts.get(call.episode)
    if cut is None:
        return
    fits = limit is None or len(cut.tokens) <= limit
    if cut.digest == call.digest and cut.params == call.params and fits:
        del restored_cuts[call.episode]
        call.tokens = list(cut.tokens)
        call.continued = len(cut.tokens)
        counts["calls_continued"] += 1
    else:
        # Kept: a later call of this attempt may be the one it belongs to.
        counts["cut_unmatched"] += 1
