"""The asynchronous commit's capture (`ray_ckpt.control.capture`): a copy that
encodes to the very bytes of the state, shares no container with it, admits
exactly what `check_json` admits, and reports its own size."""

from __future__ import annotations

import math
import sys
from typing import Any

import msgspec
import pytest

from ray_ckpt.control.capture import NotPlain, capture, copy_state
from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage.record import MAX_STATE_DEPTH, Record, check_json
from ray_ckpt.storage.records_format import StateEncoder

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
    copy, _ = copy_state(state)
    assert ENC.encode_state(copy) == ENC.encode_state(state)
    live_ids = {id(x) for x in containers(state)}
    assert not live_ids & {id(x) for x in containers(copy)}


def test_a_container_shared_twice_in_the_state_is_copied_apart_from_it() -> None:
    inner = {"a": [1]}
    state = [inner, inner]
    copy, _ = copy_state(state)
    inner["a"].append(2)
    assert copy == [{"a": [1]}, {"a": [1]}]


@pytest.mark.parametrize(
    "state",
    [
        (1, 2),
        {"a": [1, {2}]},
        {1: "int key"},
        {"a": {"b": msgspec.Raw(b"\x01")}},
        [bytearray(b"mutable")],
        type("S", (str,), {})("subclass"),
        {"a": type("D", (dict,), {})()},
    ],
)
def test_what_check_json_refuses_the_copy_refuses(state: Any) -> None:
    with pytest.raises(InvalidCheckpointState):
        check_json(state, episode="r1")
    with pytest.raises(NotPlain):
        copy_state(state)
    with pytest.raises(InvalidCheckpointState, match="episode r1"):
        capture(Record("r1", state))


def test_the_nesting_limit_is_check_jsons() -> None:
    def nest(levels: int) -> Any:
        v: Any = []
        for _ in range(levels - 1):
            v = [v]
        return v

    deepest = nest(MAX_STATE_DEPTH)
    check_json(deepest, episode="r1")
    copy, _ = copy_state(deepest)
    assert ENC.encode_state(copy) == ENC.encode_state(deepest)
    with pytest.raises(NotPlain):
        copy_state(nest(MAX_STATE_DEPTH + 1))
    with pytest.raises(InvalidCheckpointState, match="deeper than"):
        capture(Record("r1", nest(MAX_STATE_DEPTH + 1)))


def test_the_size_is_the_copys_own_containers_not_the_leaves_it_shares() -> None:
    state = {"a": "x" * 10_000, "b": [b"y" * 5_000, [1.5] * 100]}
    copy, size = copy_state(state)
    assert size == sum(sys.getsizeof(c) for c in containers(state))
    assert size < 5_000
    assert copy["a"] is state["a"]  # an immutable leaf is shared, not copied


def test_capture_keeps_key_and_version() -> None:
    rec, size = capture(Record("r1", {"a": [1]}, version="7"))
    assert (rec.key, rec.version, rec.state) == ("r1", "7", {"a": [1]})
    assert size > 0
