"""The records format round-trips exactly what a participant exported."""

from __future__ import annotations

import math
import struct
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_ckpt.storage.records.records_format import StateEncoder, decode_state


def same(a: Any, b: Any) -> bool:
    """Exact equality: types, float bits (NaN, -0.0), dict key order."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b)
    if type(a) is list:
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is dict:
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def roundtrip(value: Any) -> Any:
    return decode_state(StateEncoder().encode_state(value))


# Hypothesis' default text leaves out surrogates; mix lone ones in on purpose.
texts = st.text(alphabet=st.characters() | st.integers(0xD800, 0xDFFF).map(chr), max_size=12)
scalars = (
    st.none()
    | st.booleans()
    | st.integers()  # unbounded: beyond 64 bits too
    | st.floats(allow_nan=True, allow_infinity=True)
    | texts
    | st.binary(max_size=16)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(texts, inner, max_size=5),
    max_leaves=40,
)


@settings(max_examples=150, deadline=None)
@given(json_values)
def test_every_json_value_round_trips_exactly(value: Any) -> None:
    assert same(roundtrip(value), value)


@settings(max_examples=100, deadline=None)
@given(json_values)
def test_re_encoding_a_restored_value_gives_the_same_bytes(value: Any) -> None:
    enc = StateEncoder()
    first = enc.encode_state(value)
    assert enc.encode_state(decode_state(first)) == first


def test_the_hard_cases_by_name() -> None:
    value = {
        "z": 1,
        "a": [math.nan, math.inf, -math.inf, -0.0, 0.0, 2**63 - 1, -(2**63), 2**64 - 1],
        "big": [2**64, -(2**63) - 1, 10**40, -(10**40)],
        "lone": ["\ud800", "x\udfffy"],
        "\udc80key": b"\x00\xff",
        "nested": {"b": {"a": []}, "a": {}},
    }
    back = roundtrip(value)
    assert same(back, value)
    assert list(back) == ["z", "a", "big", "lone", "\udc80key", "nested"]
    assert math.copysign(1.0, back["a"][3]) == -1.0
    assert type(back["\udc80key"]) is bytes


def test_nan_payload_bits_survive() -> None:
    odd_nan = struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0]
    assert struct.pack("<d", roundtrip([odd_nan])[0]) == b"\x01\x00\x00\x00\x00\x00\xf8\x7f"


def test_tuples_come_back_as_lists() -> None:
    assert roundtrip({"t": (1, "a")}) == {"t": [1, "a"]}


def test_objects_are_refused() -> None:
    class Thing:
        pass

    with pytest.raises(TypeError, match="Thing"):
        StateEncoder().encode_state({"x": Thing()})


def test_unknown_extension_is_a_decode_error() -> None:
    data = msgspec.msgpack.encode(msgspec.msgpack.Ext(9, b"x"))
    with pytest.raises(ValueError, match="unknown extension"):
        decode_state(data)
