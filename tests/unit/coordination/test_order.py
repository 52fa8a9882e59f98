from __future__ import annotations

import pytest

from coordination.engine.order import (
    Member,
    commit_groups,
    forget_groups,
    prepare_groups,
    resume_groups,
    retire_groups,
)
from ray_ckpt.errors import InvalidRequest


def keys(groups: list[tuple[Member, ...]]) -> list[list[str]]:
    return [[m.key for m in g] for g in groups]


FLEET = [
    Member.parse(k)
    for k in (
        "resources/weather",
        "agent/simple",
        "model/policy",
        "environment/env-b",
        "environment/env-a",
        "resources/counter",
    )
]


def test_prepare_goes_environment_policy_agent_resources() -> None:
    assert keys(prepare_groups(FLEET)) == [
        ["environment/env-a", "environment/env-b"],
        ["model/policy"],
        ["agent/simple"],
        ["resources/counter", "resources/weather"],
    ]


def test_resume_is_prepare_reversed() -> None:
    assert resume_groups(FLEET) == list(reversed(prepare_groups(FLEET)))


def test_commit_is_everyone_at_once() -> None:
    assert keys(commit_groups(FLEET)) == [sorted(m.key for m in FLEET)]
    assert commit_groups([]) == []


def test_retire_runs_callers_before_callees() -> None:
    expected = [
        ["environment/env-a", "environment/env-b"],
        ["agent/simple"],
        ["model/policy", "resources/counter", "resources/weather"],
    ]
    assert keys(retire_groups(FLEET)) == expected
    assert keys(forget_groups(FLEET)) == expected


def test_order_follows_who_is_registered() -> None:
    only = [Member.parse("resources/r"), Member.parse("model/p")]
    assert keys(prepare_groups(only)) == [["model/p"], ["resources/r"]]
    assert keys(retire_groups(only)) == [["model/p", "resources/r"]]
    # Duplicates collapse: a participant is called once per phase.
    assert keys(prepare_groups(only + only)) == [["model/p"], ["resources/r"]]


@pytest.mark.parametrize("key", ["judge/x", "environment", "environment/", "agent/a/b"])
def test_bad_members_are_refused(key: str) -> None:
    with pytest.raises(InvalidRequest):
        Member.parse(key)
