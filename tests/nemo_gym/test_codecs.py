"""Session codecs without numpy or pandas: round trips through the records
format, and typed, path-precise refusals of what no codec handles."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import msgspec
import pytest
from pydantic import BaseModel, ConfigDict

from participants.nemo_gym import AttributesCodec, Codecs
from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage.records.record import check_json


@dataclasses.dataclass
class Board:
    cells: list[int]
    rng: random.Random
    moves: tuple[int, ...] = ()
    seen: set[str] = dataclasses.field(default_factory=set)
    cache: dict[str, int] = dataclasses.field(default_factory=dict, init=False)


class Turn(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True, extra="allow")
    index: int
    rng: random.Random
    note: str = "none"


class Opaque:
    def __init__(self, value: int) -> None:
        self.value = value


def through_records(data: Any) -> Any:
    """What a commit then a restore hand back: checked, then msgpack both ways."""
    check_json(data, episode="r")
    return msgspec.msgpack.decode(msgspec.msgpack.encode(data))


def roundtrip(codecs: Codecs, value: Any) -> Any:
    return codecs.decode(through_records(codecs.encode(value)))


def test_plain_json_passes_through_unchanged() -> None:
    codecs = Codecs()
    value = {"a": [1, 2.5, None, True, "x"], "b": {"c": {}}}
    assert codecs.encode(value) == value
    assert roundtrip(codecs, value) == value


def test_random_continues_the_same_stream() -> None:
    rng = random.Random(7)
    rng.random()
    rng.gauss(0, 1)  # gauss_next is part of the state
    copy = roundtrip(Codecs(), rng)
    assert type(copy) is random.Random
    assert [copy.random() for _ in range(5)] == [rng.random() for _ in range(5)]
    assert copy.gauss(0, 1) == rng.gauss(0, 1)


def test_containers_keep_their_types_keys_and_big_ints() -> None:
    value = {
        "t": (1, (2, 3)),
        "s": {"a", "b"},
        "f": frozenset({1, 2}),
        "ints": {0: "#", 1: "_"},
        "tuple_keys": {(1, 2): (3, 4)},
        "big": 2**100,
        "neg": -(2**70),
        "raw": b"\x00\xff",
        "$codec": "user data that looks like a tag",
    }
    back = roundtrip(Codecs(), value)
    assert back == value
    assert type(back["t"]) is tuple
    assert type(back["t"][1]) is tuple
    assert type(back["s"]) is set
    assert type(back["f"]) is frozenset
    assert list(back["ints"]) == [0, 1]


def test_dataclasses_and_pydantic_models_round_trip() -> None:
    board = Board(cells=[1, 2], rng=random.Random(1), moves=(1, 2), seen={"x"})
    board.cache["k"] = 3
    back = roundtrip(Codecs(), board)
    assert type(back) is Board
    assert back.cells == [1, 2]
    assert back.moves == (1, 2)
    assert back.seen == {"x"}
    assert back.cache == {"k": 3}  # an init=False field is restored too
    assert back.rng.random() == board.rng.random()

    turn = Turn(index=3, rng=random.Random(2), extra_field=(1, 2))
    back_turn = roundtrip(Codecs(), turn)
    assert type(back_turn) is Turn
    assert back_turn.index == 3
    assert back_turn.model_fields_set == turn.model_fields_set
    assert back_turn.model_extra == {"extra_field": (1, 2)}
    assert back_turn.rng.random() == turn.rng.random()


def test_an_unknown_type_fails_with_its_path_and_a_typed_error() -> None:
    codecs = Codecs()
    state = {"env": {"rng": random.SystemRandom()}}
    with pytest.raises(InvalidCheckpointState) as caught:
        codecs.encode(state, episode="r")
    assert caught.value.detail == (
        "episode r: state.env.rng is random.SystemRandom: register a codec"
    )
    assert caught.value.http_status == 422
    with pytest.raises(InvalidCheckpointState, match=r"state\.moves\[1\] is .*Opaque"):
        codecs.encode({"moves": [1, Opaque(2)]})
    board = Board(cells=[], rng=random.Random(), moves=(Opaque(1),))  # type: ignore[arg-type]
    with pytest.raises(InvalidCheckpointState, match=r"state\.moves\[0\] is"):
        codecs.encode(board)


def test_registered_codecs_and_attribute_codecs() -> None:
    codecs = Codecs()
    codecs.register(Opaque, AttributesCodec(Opaque, ["value"], make=lambda a: Opaque(0)))
    back = roundtrip(codecs, {"o": (Opaque(5),)})
    assert type(back["o"][0]) is Opaque
    assert back["o"][0].value == 5
    # Exact types only: a subclass may hold state its base's codec does not know.

    class Sub(Opaque):
        pass

    with pytest.raises(InvalidCheckpointState, match="Sub: register a codec"):
        codecs.encode(Sub(1))


def test_a_failing_codec_is_reported_as_invalid_state_not_a_type_error() -> None:
    class Broken:
        def encode(self, value: Any) -> Any:
            raise TypeError("cannot")

        def decode(self, data: Any) -> Any:
            raise KeyError("x")

    codecs = Codecs()
    codecs.register(Opaque, Broken(), tag="opaque")
    with pytest.raises(InvalidCheckpointState, match=r"state\.x is .*Opaque: its codec failed"):
        codecs.encode({"x": Opaque(1)})
    with pytest.raises(InvalidCheckpointState, match="codec 'opaque' failed"):
        codecs.decode({"$codec": "opaque", "data": 1})


@pytest.mark.parametrize(
    "data",
    [
        {"$codec": "nope", "data": 1},
        {"$codec": "tuple"},
        {"$codec": "tuple", "data": 5},
        {"$codec": "dict", "data": [[1]]},
        {"$codec": "dataclass", "data": {"type": "os:system", "fields": {}}},
        {"$codec": "pydantic", "data": {"type": "no.such.module:X", "fields": {}}},
        {"$codec": "int", "data": "twelve"},
    ],
)
def test_malformed_data_is_refused_typed(data: Any) -> None:
    with pytest.raises(InvalidCheckpointState):
        Codecs().decode(data)


def test_reserved_tags_cannot_be_registered() -> None:
    with pytest.raises(ValueError, match="reserved"):
        Codecs().register(Opaque, AttributesCodec(Opaque, []), tag="tuple")
