"""pandas codecs: `DataFrame` and `Series`, with their dtypes and index.

Each column travels as a numpy array (numeric, bool, datetime and object
columns, through the array codec) or, for pandas' own string and nullable
dtypes, as its items plus the dtype's name.  Other extension dtypes
(categoricals, intervals, time zones) are refused by name rather than
restored approximately; register a codec for them.  So is a `MultiIndex`.
"""

from __future__ import annotations

from typing import Any

from ray_ckpt.errors import InvalidCheckpointState

# Extension dtypes whose items alone, plus the dtype's name, rebuild them exactly.
_BY_NAME = frozenset(
    {"string", "str", "boolean", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16"}
    | {"UInt32", "UInt64", "Float32", "Float64"}
)


def _values(values: Any, dtype: Any, what: str) -> dict[str, Any]:
    import numpy as np

    if isinstance(dtype, np.dtype):
        return {"numpy": np.asarray(values)}
    name = str(dtype)
    if name not in _BY_NAME:
        raise InvalidCheckpointState(f"{what} has pandas dtype {name!r}: register a codec")
    # Missing values as None: pd.NA is not JSON, and None maps back to the dtype's own NA.
    items = [None if _is_missing(v) else v for v in values.to_numpy(dtype=object).tolist()]
    return {"dtype": name, "items": items}


def _is_missing(value: Any) -> bool:
    import pandas as pd

    return value is pd.NA or (isinstance(value, float) and value != value)


def _restore(data: dict[str, Any]) -> Any:
    import pandas as pd

    if "numpy" in data:
        return data["numpy"]
    return pd.array(data["items"], dtype=data["dtype"])


def _index(index: Any) -> dict[str, Any]:
    import pandas as pd

    if isinstance(index, pd.MultiIndex):
        raise InvalidCheckpointState("a MultiIndex: register a codec")
    if isinstance(index, pd.RangeIndex):
        return {"range": [index.start, index.stop, index.step], "name": index.name}
    return {"values": _values(index, index.dtype, "an index"), "name": index.name}


def _restore_index(data: dict[str, Any]) -> Any:
    import pandas as pd

    if "range" in data:
        start, stop, step = data["range"]
        return pd.RangeIndex(start, stop, step, name=data["name"])
    return pd.Index(_restore(data["values"]), name=data["name"])


class DataFrameCodec:
    def encode(self, value: Any) -> Any:
        columns = [
            _values(value.iloc[:, i], dtype, f"column {name!r}")
            for i, (name, dtype) in enumerate(value.dtypes.items())
        ]
        return {"columns": _index(value.columns), "index": _index(value.index), "data": columns}

    def decode(self, data: Any) -> Any:
        import pandas as pd

        index = _restore_index(data["index"])
        # Positional keys first: column names may repeat or be of any type.
        frame = pd.DataFrame(
            {i: pd.Series(_restore(col), index=index) for i, col in enumerate(data["data"])},
            index=index,
        )
        frame.columns = _restore_index(data["columns"])
        return frame


class SeriesCodec:
    def encode(self, value: Any) -> Any:
        return {
            "name": value.name,
            "index": _index(value.index),
            "data": _values(value, value.dtype, f"series {value.name!r}"),
        }

    def decode(self, data: Any) -> Any:
        import pandas as pd

        index = _restore_index(data["index"])
        return pd.Series(_restore(data["data"]), index=index, name=data["name"])
