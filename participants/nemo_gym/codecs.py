"""Session codecs: turning a NeMo Gym server's session state into JSON data and back.

NeMo Gym servers keep per-session state as Python objects (`random.Random`,
numpy generators and arrays, pandas DataFrames, dataclasses, pydantic models),
none of which the records format takes.  A `SessionCodec` handles one type;
`Codecs` is the per-server registry that walks a state, encodes every value
it holds, and decodes the result back to equal objects.

Plain JSON (None, bool, int, float, str, lists, dicts with str keys) passes
through unchanged; anything else becomes a tagged object
``{"$codec": <tag>, "data": ...}``.  Tuples, sets, frozensets, dicts with
other keys, bytes, dataclasses and pydantic models are handled by the
registry itself (their members are walked too); the other built-ins live in
`participants.nemo_gym.builtin_codecs`.

A value of a type nobody registered fails the export with a typed
`InvalidCheckpointState` naming where it sits
(``episode r: state.env.rng is random.Random: register a codec``): state is
never silently dropped or stringified.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from participants.nemo_gym.builtin_codecs import register_builtins
from ray_ckpt.errors import InvalidCheckpointState

T = TypeVar("T")
TAG = "$codec"
# Python ints beyond what the records format keeps (msgpack: 64 bits) travel as text.
_INT_LIMIT = 2**63


@runtime_checkable
class SessionCodec(Protocol):
    """Encodes values of one type to JSON data and back (`decode(encode(v)) == v`).

    `encode` may return any value the registry can encode in turn (it walks the
    result, so a codec can hand back tuples, arrays or other registered types).
    """

    def encode(self, value: Any) -> Any: ...

    def decode(self, data: Any) -> Any: ...


class _Entry:
    __slots__ = ("codec", "tag", "type")

    def __init__(self, type_: type, tag: str, codec: SessionCodec) -> None:
        self.type = type_
        self.tag = tag
        self.codec = codec


def type_name(t: type) -> str:
    """``module.Qualname`` as a user would write it (``random.Random``, ``int``)."""
    module = t.__module__
    return t.__qualname__ if module == "builtins" else f"{module}.{t.__qualname__}"


def _class_ref(t: type) -> str:
    return f"{t.__module__}:{t.__qualname__}"


def _import_class(ref: str, what: str, check: Callable[[Any], bool]) -> type:
    module, _, qualname = ref.partition(":")
    try:
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise InvalidCheckpointState(f"{what} {ref!r} cannot be imported: {exc}") from None
    # Only classes of the expected sort: a record cannot name any callable.
    if not isinstance(target, type) or not check(target):
        raise InvalidCheckpointState(f"{ref!r} is not a {what}")
    return target


def _is_pydantic(t: type) -> bool:
    try:
        from pydantic import BaseModel
    except ImportError:  # pragma: no cover - pydantic is a dependency
        return False
    return issubclass(t, BaseModel)


class Codecs:
    """A per-server registry of codecs, with the built-ins already registered."""

    def __init__(self, *, builtins: bool = True) -> None:
        self._by_type: dict[type, _Entry] = {}
        self._by_tag: dict[str, _Entry] = {}
        if builtins:
            register_builtins(self)

    def register(self, type_: type, codec: SessionCodec, *, tag: str | None = None) -> None:
        """Use `codec` for values whose type is exactly `type_` (not subclasses:
        a subclass may carry more state than its base's codec knows)."""
        if not isinstance(codec, SessionCodec):
            raise TypeError(f"{codec!r} has no encode/decode")
        name = tag or type_name(type_)
        if name in _RESERVED or name.startswith("py:"):
            raise ValueError(f"codec tag {name!r} is reserved")
        entry = _Entry(type_, name, codec)
        self._by_type[type_] = entry
        self._by_tag[name] = entry

    def registered(self) -> list[str]:
        return sorted(self._by_tag)

    # --- encode ------------------------------------------------------------------
    def encode(self, value: Any, *, path: str = "state", episode: str | None = None) -> Any:
        """JSON data for `value`; `InvalidCheckpointState` names the first value
        no codec handles (`path` is where the walk starts)."""
        try:
            return self._enc(value, path, 0)
        except InvalidCheckpointState as exc:
            if episode is None:
                raise
            raise InvalidCheckpointState(f"episode {episode}: {exc.detail}") from None

    def _enc(self, value: Any, path: str, depth: int) -> Any:
        if depth > 200:
            raise InvalidCheckpointState(f"{path} nests deeper than 200 levels")
        t = type(value)
        if value is None or t is bool or t is str or t is float:
            return value
        if t is int:
            if -_INT_LIMIT <= value < _INT_LIMIT:
                return value
            return _tagged("int", str(value))
        if t is list:
            return [self._enc(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
        if t is dict:
            if all(type(k) is str for k in value) and TAG not in value:
                return {k: self._enc(v, f"{path}.{k}", depth + 1) for k, v in value.items()}
            return _tagged("dict", self._pairs(value, path, depth))
        entry = self._by_type.get(t)
        if entry is not None:
            try:
                data = entry.codec.encode(value)
            except InvalidCheckpointState as exc:
                raise InvalidCheckpointState(f"{path} is {type_name(t)}: {exc.detail}") from None
            except Exception as exc:
                raise InvalidCheckpointState(
                    f"{path} is {type_name(t)}: its codec failed: {exc!r}"[:500]
                ) from None
            return _tagged(entry.tag, self._enc(data, f"{path}", depth + 1))
        if t is tuple:
            return _tagged(
                "tuple", [self._enc(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
            )
        if t is set or t is frozenset:
            items = [self._enc(v, f"{path}{{}}", depth + 1) for v in value]
            return _tagged(t.__name__, items)
        if t is bytes:
            return _tagged("bytes", value)
        if dataclasses.is_dataclass(value) and isinstance(t, type):
            fields = {
                f.name: self._enc(getattr(value, f.name), f"{path}.{f.name}", depth + 1)
                for f in dataclasses.fields(value)
            }
            return _tagged("dataclass", {"type": _class_ref(t), "fields": fields})
        if _is_pydantic(t):
            return _tagged("pydantic", self._model(value, path, depth))
        raise InvalidCheckpointState(f"{path} is {type_name(t)}: register a codec")

    def _pairs(self, value: dict[Any, Any], path: str, depth: int) -> list[Any]:
        return [
            [self._enc(k, f"{path}<key>", depth + 1), self._enc(v, f"{path}[{k!r}]", depth + 1)]
            for k, v in value.items()
        ]

    def _model(self, value: Any, path: str, depth: int) -> dict[str, Any]:
        t = type(value)
        fields = {
            name: self._enc(getattr(value, name), f"{path}.{name}", depth + 1)
            for name in t.model_fields
        }
        extra = value.__pydantic_extra__ or {}
        return {
            "type": _class_ref(t),
            "fields": fields,
            "extra": {k: self._enc(v, f"{path}.{k}", depth + 1) for k, v in extra.items()},
            "set": sorted(value.model_fields_set),
        }

    # --- decode ------------------------------------------------------------------
    def decode(self, data: Any, *, path: str = "state") -> Any:
        """The value `encode` was given; `InvalidCheckpointState` for bad data."""
        return self._dec(data, path)

    def _dec(self, data: Any, path: str) -> Any:
        t = type(data)
        if t is list:
            return [self._dec(v, f"{path}[{i}]") for i, v in enumerate(data)]
        if t is not dict:
            return data
        if TAG not in data:
            return {k: self._dec(v, f"{path}.{k}") for k, v in data.items()}
        if set(data) != {TAG, "data"} or not isinstance(data[TAG], str):
            raise InvalidCheckpointState(f"{path}: malformed codec object {sorted(data)}")
        tag, inner = data[TAG], data["data"]
        structural = _STRUCTURAL.get(tag)
        if structural is not None:
            try:
                return structural(self, inner, path)
            except InvalidCheckpointState:
                raise
            except Exception as exc:
                raise InvalidCheckpointState(f"{path}: bad {tag} data: {exc!r}"[:500]) from None
        entry = self._by_tag.get(tag)
        if entry is None:
            raise InvalidCheckpointState(f"{path}: no codec {tag!r} is registered")
        value = self._dec(inner, path)
        try:
            return entry.codec.decode(value)
        except InvalidCheckpointState as exc:
            raise InvalidCheckpointState(f"{path}: {exc.detail}") from None
        except Exception as exc:
            raise InvalidCheckpointState(f"{path}: codec {tag!r} failed: {exc!r}"[:500]) from None


def _tagged(tag: str, data: Any) -> dict[str, Any]:
    return {TAG: tag, "data": data}


def _dec_list(codecs: Codecs, inner: Any, path: str) -> list[Any]:
    if not isinstance(inner, list):
        raise InvalidCheckpointState(f"{path}: expected a list")
    return [codecs._dec(v, f"{path}[{i}]") for i, v in enumerate(inner)]


def _dec_dict(codecs: Codecs, inner: Any, path: str) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for pair in _dec_list(codecs, inner, path):
        key, value = pair
        out[key] = value
    return out


def _dec_dataclass(codecs: Codecs, inner: Any, path: str) -> Any:
    cls = _import_class(inner["type"], "dataclass", dataclasses.is_dataclass)
    fields = {k: codecs._dec(v, f"{path}.{k}") for k, v in inner["fields"].items()}
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    obj = cls(**{k: v for k, v in fields.items() if k in init})
    for name, value in fields.items():
        if name not in init:  # init=False fields are set as they were
            object.__setattr__(obj, name, value)
    return obj


def _dec_pydantic(codecs: Codecs, inner: Any, path: str) -> Any:
    cls: Any = _import_class(inner["type"], "pydantic model", _is_pydantic)
    fields = {k: codecs._dec(v, f"{path}.{k}") for k, v in inner["fields"].items()}
    extra = {k: codecs._dec(v, f"{path}.{k}") for k, v in inner["extra"].items()}
    # model_construct, not model_validate: restore the values exactly as they
    # were (validators may transform), with the same set of explicitly set fields.
    return cls.model_construct(_fields_set=set(inner["set"]), **fields, **extra)


def _dec_int(codecs: Codecs, inner: Any, path: str) -> int:
    return int(inner)


def _dec_bytes(codecs: Codecs, inner: Any, path: str) -> bytes:
    if not isinstance(inner, bytes):
        raise InvalidCheckpointState(f"{path}: expected bytes")
    return inner


_STRUCTURAL: dict[str, Callable[[Codecs, Any, str], Any]] = {
    "int": _dec_int,
    "bytes": _dec_bytes,
    "dict": _dec_dict,
    "tuple": lambda c, d, p: tuple(_dec_list(c, d, p)),
    "set": lambda c, d, p: set(_dec_list(c, d, p)),
    "frozenset": lambda c, d, p: frozenset(_dec_list(c, d, p)),
    "dataclass": _dec_dataclass,
    "pydantic": _dec_pydantic,
}
_RESERVED = frozenset(_STRUCTURAL)
