"""The participant order: a pure function of who is registered.

Callers go before the servers they call.  Prepare parks the callers first so
the servers they call see no new work: environment servers park their
episodes, then the policy model closes admission (so agents waiting on it are
at a boundary), then agents, then resources, which agents and environments
call until they park.  Resume runs the same groups in reverse, so a server is
open again before anything that calls it.  Commit and restore touch every
participant at once.  Retire and forget stop callers before callees.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ray_ckpt.control.protocol import KINDS
from ray_ckpt.errors import InvalidRequest

PREPARE_STAGES: tuple[tuple[str, ...], ...] = (
    ("environment",),
    ("model",),
    ("agent",),
    ("resources",),
)
RETIRE_STAGES: tuple[tuple[str, ...], ...] = (
    ("environment",),
    ("agent",),
    ("model", "resources"),
)


@dataclass(frozen=True, order=True)
class Member:
    """One registered participant, `<kind>/<name>`."""

    kind: str
    name: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest(f"unknown participant kind {self.kind!r}; expected one of {KINDS}")
        if not self.name or "/" in self.name:
            raise InvalidRequest(f"bad participant name {self.name!r}")

    @property
    def key(self) -> str:
        return f"{self.kind}/{self.name}"

    @classmethod
    def parse(cls, key: str) -> Member:
        kind, sep, name = key.partition("/")
        if not sep:
            raise InvalidRequest(f"participant key {key!r} is not <kind>/<name>")
        return cls(kind, name)


Groups = list[tuple[Member, ...]]


def _staged(members: Iterable[Member], stages: Sequence[tuple[str, ...]]) -> Groups:
    unique = sorted(set(members))
    groups: Groups = []
    for stage in stages:
        group = tuple(m for m in unique if m.kind in stage)
        if group:  # a kind nobody registered is no step at all
            groups.append(group)
    return groups


def prepare_groups(members: Iterable[Member]) -> Groups:
    """environment → model → agent → resources; empty stages skipped."""
    return _staged(members, PREPARE_STAGES)


def resume_groups(members: Iterable[Member]) -> Groups:
    """The prepare groups in reverse: every callee is open before its callers."""
    return list(reversed(prepare_groups(members)))


def commit_groups(members: Iterable[Member]) -> Groups:
    """Everyone at once (commit and restore have no order between participants)."""
    unique = tuple(sorted(set(members)))
    return [unique] if unique else []


restore_groups = commit_groups


def retire_groups(members: Iterable[Member]) -> Groups:
    """environment → agent → (model, resources): callers before callees."""
    return _staged(members, RETIRE_STAGES)


forget_groups = retire_groups
