"""The built-in session codecs (`random.Random`, numpy, pandas) and `AttributesCodec`.

numpy and pandas are optional: their codecs are registered only when the
package imports (a server that holds a numpy array has numpy installed).
Every codec restores an equal object: a generator continues the same stream,
an array has the same dtype, shape and bytes, a DataFrame the same columns,
dtypes, index and values.

They register with any `Registry` (what `register_builtins` needs of
`participants.nemo_gym.codecs.Codecs`), so the registry imports them and
never the other way round.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from ray_ckpt.errors import InvalidCheckpointState


class Registry(Protocol):
    """Where the built-ins go: a codec registry's `register`."""

    def register(self, type_: type, codec: Any, *, tag: str | None = None) -> None: ...


class RandomCodec:
    """`random.Random`: its full Mersenne Twister state (`getstate`)."""

    def encode(self, value: random.Random) -> Any:
        return value.getstate()

    def decode(self, data: Any) -> random.Random:
        rng = random.Random()
        rng.setstate(data)
        return rng


class AttributesCodec:
    """Objects of a class as a chosen set of their attributes.

    `make(attrs)` builds a fresh object from the decoded attributes (e.g. runs
    the constructor with the saved config), then each attribute is set on it.
    Without `make`, the object is created without calling `__init__`.
    """

    def __init__(
        self, cls: type, attrs: Iterable[str], make: Callable[[dict[str, Any]], Any] | None = None
    ) -> None:
        self.cls = cls
        self.attrs = tuple(attrs)
        self.make = make

    def encode(self, value: Any) -> Any:
        return {name: getattr(value, name) for name in self.attrs}

    def decode(self, data: Any) -> Any:
        obj = self.make(data) if self.make is not None else object.__new__(self.cls)
        for name, value in data.items():
            setattr(obj, name, value)
        return obj


def register_builtins(codecs: Registry) -> None:
    codecs.register(random.Random, RandomCodec(), tag="random.Random")
    try:
        import numpy
    except ImportError:
        pass
    else:
        _register_numpy(codecs, numpy)
    try:
        import pandas
    except ImportError:
        pass
    else:
        from participants.nemo_gym.pandas_codecs import DataFrameCodec, SeriesCodec

        codecs.register(pandas.DataFrame, DataFrameCodec(), tag="pandas.DataFrame")
        codecs.register(pandas.Series, SeriesCodec(), tag="pandas.Series")


# --- numpy ------------------------------------------------------------------------

# The bit generators a `Generator` may be rebuilt from (names in its state).
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


class NdarrayCodec:
    """An array as dtype, shape and raw bytes; object arrays as their items."""

    def encode(self, value: Any) -> Any:
        import numpy as np

        if value.dtype.fields is not None:
            raise InvalidCheckpointState(f"a structured array ({value.dtype}): register a codec")
        shape = list(value.shape)
        if value.dtype == np.dtype(object):
            return {"dtype": "object", "shape": shape, "items": value.ravel().tolist()}
        return {
            "dtype": value.dtype.str,
            "shape": shape,
            "bytes": np.ascontiguousarray(value).tobytes(),
        }

    def decode(self, data: Any) -> Any:
        import numpy as np

        shape = tuple(data["shape"])
        if data["dtype"] == "object":
            out = np.empty(len(data["items"]), dtype=object)
            out[:] = data["items"]
            return out.reshape(shape)
        # A copy: frombuffer's array is read-only and shares the record's bytes.
        return np.frombuffer(data["bytes"], dtype=np.dtype(data["dtype"])).reshape(shape).copy()


class NumpyScalarCodec:
    """A numpy scalar (`np.float64(0.5)`, `np.int64(3)`) as dtype and bytes."""

    def encode(self, value: Any) -> Any:
        return {"dtype": value.dtype.str, "bytes": value.tobytes()}

    def decode(self, data: Any) -> Any:
        import numpy as np

        return np.frombuffer(data["bytes"], dtype=np.dtype(data["dtype"]))[0]


class GeneratorCodec:
    """`numpy.random.Generator`: its bit generator's name and state."""

    def encode(self, value: Any) -> Any:
        return value.bit_generator.state

    def decode(self, data: Any) -> Any:
        import numpy as np

        name = data.get("bit_generator")
        if name not in _BIT_GENERATORS:
            raise InvalidCheckpointState(f"unknown numpy bit generator {name!r}")
        bit_generator = getattr(np.random, name)()
        bit_generator.state = data
        return np.random.Generator(bit_generator)


class RandomStateCodec:
    """`numpy.random.RandomState` (what `np.random.seed` drives): its MT19937 state."""

    def encode(self, value: Any) -> Any:
        return value.get_state(legacy=False)

    def decode(self, data: Any) -> Any:
        import numpy as np

        rng = np.random.RandomState()
        rng.set_state(data)
        return rng


def _register_numpy(codecs: Registry, np: Any) -> None:
    codecs.register(np.ndarray, NdarrayCodec(), tag="numpy.ndarray")
    codecs.register(np.random.Generator, GeneratorCodec(), tag="numpy.random.Generator")
    codecs.register(np.random.RandomState, RandomStateCodec(), tag="numpy.random.RandomState")
    scalar = NumpyScalarCodec()
    for t in sorted(set(np.sctypeDict.values()), key=lambda t: t.__name__):
        if t in (np.object_, np.void):
            continue
        codecs.register(t, scalar, tag=f"numpy.{t.__name__}")
