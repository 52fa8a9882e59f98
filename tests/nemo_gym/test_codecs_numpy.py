"""The numpy and pandas codecs, through the records format.  numpy and pandas
are not in the main venv: these run with the NeMo Gym servers' packages."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from participants.nemo_gym import Codecs
from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage.records.record import check_json

pytestmark = pytest.mark.nemo_gym


def roundtrip(value: Any) -> Any:
    codecs = Codecs()
    data = codecs.encode(value, episode="r")
    check_json(data, episode="r")
    return codecs.decode(msgspec.msgpack.decode(msgspec.msgpack.encode(data)))


def test_generators_continue_their_streams() -> None:
    np = pytest.importorskip("numpy")
    for gen in (np.random.default_rng(3), np.random.Generator(np.random.MT19937(4))):
        gen.random(5)
        copy = roundtrip(gen)
        assert type(copy.bit_generator) is type(gen.bit_generator)
        assert (copy.random(8) == gen.random(8)).all()
    legacy = np.random.RandomState(5)
    legacy.standard_normal()  # leaves a cached gaussian in the state
    copy = roundtrip(legacy)
    assert (copy.standard_normal(4) == legacy.standard_normal(4)).all()


def test_arrays_and_scalars_keep_dtype_shape_and_values() -> None:
    np = pytest.importorskip("numpy")
    arrays = [
        np.arange(12, dtype=np.int64).reshape(3, 4),
        np.asfortranarray(np.linspace(0, 1, 6).reshape(2, 3)),
        np.arange(10)[::3],  # not contiguous
        np.array([True, False]),
        np.array(["2023-01-01", "2024-02-02"], dtype="datetime64[ns]"),
        np.array(["ab", "c"]),
        np.array(7.5),
        np.array([1, "x", None], dtype=object),
    ]
    for arr in arrays:
        back = roundtrip(arr)
        assert back.dtype == arr.dtype
        assert back.shape == arr.shape
        assert back.tolist() == arr.tolist()
        back.flat[0] = back.flat[0]  # writable, not a view of the record's bytes
    for scalar in (np.int64(3), np.float32(0.25), np.bool_(True), np.uint8(255)):
        back = roundtrip(scalar)
        assert type(back) is type(scalar)
        assert back == scalar
    # A dict keyed by tuples of numpy ints (gym_sokoban's box mapping).
    mapping = {(np.int64(2), np.int64(1)): (np.int64(3), np.int64(1))}
    back = roundtrip(mapping)
    assert back == mapping
    assert type(next(iter(back))[0]) is np.int64


def test_dataframes_keep_columns_dtypes_index_and_missing_values() -> None:
    pd = pytest.importorskip("pandas")
    np = pytest.importorskip("numpy")
    frame = pd.DataFrame(
        {
            "id": pd.array(["001", "002", None], dtype="str"),
            "n": [1, 2, 3],
            "x": [0.5, np.nan, 2.0],
            "when": pd.to_datetime(["2023-01-01", "2023-01-02", "2023-01-03"]),
            "obj": [1, "a", None],
            "maybe": pd.array([1, None, 3], dtype="Int64"),
        },
        index=[10, 10, 30],  # not a range, and repeated (pd.concat without ignore_index)
    )
    back = roundtrip(frame)
    pd.testing.assert_frame_equal(back, frame)
    assert list(back.dtypes) == list(frame.dtypes)
    empty = pd.DataFrame(columns=["file_path"])
    pd.testing.assert_frame_equal(roundtrip(empty), empty)
    series = pd.Series([1.5, 2.5], index=["a", "b"], name="s")
    pd.testing.assert_series_equal(roundtrip(series), series)


def test_unsupported_pandas_shapes_are_refused_by_name() -> None:
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"c": pd.Categorical(["a", "b"])})
    with pytest.raises(InvalidCheckpointState) as caught:
        Codecs().encode({"t": frame}, episode="r")
    assert caught.value.detail == (
        "episode r: state.t is pandas.DataFrame: "
        "column 'c' has pandas dtype 'category': register a codec"
    )
    multi = pd.DataFrame({"a": [1]}, index=pd.MultiIndex.from_tuples([(1, 2)]))
    with pytest.raises(InvalidCheckpointState, match="MultiIndex"):
        Codecs().encode(multi)
