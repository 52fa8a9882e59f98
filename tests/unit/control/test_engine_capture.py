"""The asynchronous commit's capture (`ray_ckpt.control.capture`): a copy that
encodes to the very bytes of the state and shares no container with it; what
`check_json` refuses is refused under the pause or by the write's audit
after it (but for the values equal to their plain form, written plain); the
audit measures the copy."""

from __future__ import annotations

import collections
import enum
import math
import sys
from typing import Any

import msgspec
import pytest

from ray_ckpt.control.capture import Audited, NotPlain, audit, capture, copy_state
from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage.records.record import MAX_STATE_DEPTH, Record, check_json
from ray_ckpt.storage.records.records_format import StateEncoder

ENC = StateEncoder()


def containers(v: Any) -> list[Any]:
    out = []
    if type(v) is dict:
        out.append(v)
        for x in v.values():
            out += containers(x)
    elif type(v) is list:
        out.append(v)
        for x in v:
            out += containers(x)
    return out


STATES: list[Any] = [
    None,
    "text",
    b"\xff",
    2**70,
    math.nan,
    [],
    {},
    {"z": 1, "a": [1, 2, {"k": [b"x", None, True, -0.0]}], "m": {"\ud800": "lone"}},
    [[[[]]], {"a": {"b": {"c": "d" * 3000}}}],
    {"ints": list(range(100)), "floats": [0.5] * 50, "mixed": [1, "a", b"b", None]},
]


@pytest.mark.parametrize("state", STATES)
def test_the_copy_encodes_to_the_same_bytes_and_shares_no_container(state: Any) -> None:
    copy = capture(Record("r1", state)).state
    assert ENC.encode_state(copy) == ENC.encode_state(state)
    live_ids = {id(x) for x in containers(state)}
    assert not live_ids & {id(x) for x in containers(copy)}
    audit([Record("r1", copy)])  # and it passes the audit


def test_a_container_shared_twice_in_the_state_is_copied_apart_from_it() -> None:
    inner = {"a": [1]}
    state = [inner, inner]
    copy = copy_state(state)
    inner["a"].append(2)
    assert copy == [{"a": [1]}, {"a": [1]}]


class Plain(enum.Enum):
    A = "a"


@pytest.mark.parametrize(
    "state",
    [
        {"a": [1, {2}]},
        {"a": {"b": msgspec.Raw(b"\x01")}},
        [bytearray(b"mutable")],
        type("S", (str,), {})("subclass"),
        {"e": Plain.A},
        {"c": 1j},
        {"o": object()},
    ],
)
def test_what_the_copy_would_change_is_refused_under_the_pause(state: Any) -> None:
    with pytest.raises(InvalidCheckpointState):
        check_json(state, episode="r1")
    with pytest.raises(NotPlain):
        copy_state(state)
    with pytest.raises(InvalidCheckpointState, match="episode r1"):
        capture(Record("r1", state))


@pytest.mark.parametrize("state", [(1, 2), {"t": [(1,)]}, {1: "int key"}, {"a": {2.5: 1}}])
def test_what_survives_the_copy_unchanged_is_refused_by_the_audit(state: Any) -> None:
    with pytest.raises(InvalidCheckpointState):
        check_json(state, episode="r1")
    rec = capture(Record("r1", state))  # the pause does not look ...
    with pytest.raises(InvalidCheckpointState, match="episode r1"):
        audit([Record("r0", {"fine": 1}), rec])  # ... the write does, before a byte


class Level(enum.IntEnum):
    HIGH = 2


class Colour(str, enum.Enum):
    RED = "red"


@pytest.mark.parametrize(
    ("value", "plain"),
    [
        (Level.HIGH, 2),
        (Colour.RED, "red"),
        (collections.OrderedDict(b=1, a=2), {"b": 1, "a": 2}),
        (collections.defaultdict(list, k=[1]), {"k": [1]}),
        (type("L", (list,), {})([1, 2]), [1, 2]),
    ],
)
def test_a_value_equal_to_its_plain_form_is_written_plain(value: Any, plain: Any) -> None:
    """The documented difference from the synchronous commit, which refuses
    these: the asynchronous capture writes the plain form, equal to it."""
    state = {"v": value}
    with pytest.raises(InvalidCheckpointState):
        check_json(state, episode="r1")
    copy = capture(Record("r1", state)).state
    assert type(copy["v"]) is type(plain) and copy["v"] == plain == value
    assert list(copy["v"]) == list(plain) if isinstance(plain, dict) else True
    audit([Record("r1", copy)])


def test_a_nan_at_the_top_is_not_equal_to_itself_and_still_captured() -> None:
    rec = capture(Record("r1", math.nan))
    assert math.isnan(rec.state)


def test_the_nesting_limit_is_check_jsons() -> None:
    def nest(levels: int) -> Any:
        v: Any = []
        for _ in range(levels - 1):
            v = [v]
        return v

    deepest = nest(MAX_STATE_DEPTH)
    check_json(deepest, episode="r1")
    copy = capture(Record("r1", deepest)).state
    assert ENC.encode_state(copy) == ENC.encode_state(deepest)
    audit([Record("r1", copy)])
    too_deep = capture(Record("r1", nest(MAX_STATE_DEPTH + 1)))
    with pytest.raises(InvalidCheckpointState, match="deeper than"):
        audit([too_deep])


def test_the_size_is_the_copys_own_containers_not_the_leaves_it_shares() -> None:
    state = {"a": "x" * 10_000, "b": [b"y" * 5_000, [1.5] * 100]}
    copy = copy_state(state)
    size = audit([Record("r1", copy), Record("r2", copy_state([[]]))])
    assert size == sum(sys.getsizeof(c) for c in containers(state) + containers([[]]))
    assert size < 5_000
    assert copy["a"] is state["a"]  # an immutable leaf is shared, not copied


def test_capture_keeps_key_and_version() -> None:
    rec = capture(Record("r1", {"a": [1]}, version="7"))
    assert (rec.key, rec.version, rec.state) == ("r1", "7", {"a": [1]})


def test_audited_records_are_checked_as_they_are_read_once_each() -> None:
    good = [capture(Record(f"r{i}", {"i": [i]})) for i in range(3)]
    bad = capture(Record("r3", {"t": (1,)}))
    records = Audited([*good, bad, capture(Record("r4", {}))])
    seen = iter(records)
    assert next(seen).key == "r0"  # the first is handed on before the rest are walked
    assert records.size is None
    with pytest.raises(InvalidCheckpointState, match=r"episode r3: state\.t is a tuple"):
        list(seen)
    assert records.size is None
    # A retried write reads from the start: the audited ones pass, the bad one fails again.
    with pytest.raises(InvalidCheckpointState, match="episode r3"):
        list(records)
    fine = Audited(good)
    assert [r.key for r in fine] == ["r0", "r1", "r2"]
    assert fine.size == audit(good) > 0
    assert [r.key for r in fine] == ["r0", "r1", "r2"]  # read again: measured once
    assert fine.size == audit(good)
    assert Audited([]).size == 0
