"""Calling the coordinator actor: one place that turns Ray's failures into ours.

The handle's methods are a flat API of sync/async twins, made here from one
definition each: the operation states its `Call` (the coordinator method, its
arguments, how its reply is shaped) and `twins` makes `name` and `aname` of
it.  Both go through `CoordinatorCalls`, so a remote `CheckpointError` arrives
as the project's own class with its own message (never Ray's dual-class
wrapper whose `str()` is the remote traceback), and a dead coordinator as
`ParticipantUnavailable`.  The episode arguments every method takes are
normalised here too.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import re
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Concatenate, Generic, Literal, ParamSpec, Protocol, TypeVar

from coordination.reach.hosts import _unwrap_ray_error
from coordination.triggers.periodic import episode_list
from ray_ckpt.identity import EpisodeId

EpisodeLike = EpisodeId | str | tuple[str, int]


def episodes(items: Iterable[EpisodeLike] | None) -> list[EpisodeId] | None:
    """EpisodeIds from EpisodeIds, capture keys (`r`, `r-a2`) or (rollout, attempt)."""
    return None if items is None else episode_list(items)


def restore_args(
    episode_ids: Iterable[EpisodeLike] | Literal["latest"] | None, latest: bool
) -> tuple[list[EpisodeId] | None, bool]:
    """(episodes, latest) of `restore(where, episode_ids)`: `"latest"` reads
    `where` as a root and restores every episode its newest checkpoint holds."""
    if episode_ids == "latest":
        return None, True
    return episodes(episode_ids), latest


T = TypeVar("T")
U = TypeVar("U")
P = ParamSpec("P")


def _as_sent(reply: Any) -> Any:
    return reply


class Call(Generic[T]):
    """One operation of the handle, stated once for both twins.

    `method` names the coordinator actor's method; a callable runs here
    instead (in a worker thread for the async twin: it reads storage).
    `then(shape)`: how the reply becomes what the caller gets."""

    def __init__(self, method: str | Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        self.method = method
        self.args = args
        self.kwargs = kwargs
        self.shape: Callable[[Any], T] = _as_sent

    def then(self, shape: Callable[[Any], U]) -> Call[U]:
        shaped: Call[U] = Call(self.method, *self.args, **self.kwargs)
        shaped.shape = shape
        return shaped

    @property
    def what(self) -> str:
        name = self.method if isinstance(self.method, str) else self.method.__name__
        return f"coordinator {name}"


class CoordinatorCalls:
    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def run(self, call: Call[T]) -> T:
        if not isinstance(call.method, str):
            return call.shape(call.method(*call.args, **call.kwargs))
        import ray

        try:
            reply = ray.get(getattr(self.actor, call.method).remote(*call.args, **call.kwargs))
        except Exception as exc:
            # No `except CheckpointError: raise` first: Ray's `RayTaskError`
            # for a remote CheckpointError is also an instance of it (a
            # dual-class wrapper whose str() is the remote traceback).
            raise _unwrap_ray_error(exc, call.what) from None
        return call.shape(reply)

    async def arun(self, call: Call[T]) -> T:
        if not isinstance(call.method, str):
            return call.shape(await asyncio.to_thread(call.method, *call.args, **call.kwargs))
        try:
            reply = await getattr(self.actor, call.method).remote(*call.args, **call.kwargs)
        except Exception as exc:
            raise _unwrap_ray_error(exc, call.what) from None
        return call.shape(reply)


class HasCalls(Protocol):
    _calls: CoordinatorCalls


H = TypeVar("H", bound=HasCalls)


def twins(
    op: Callable[Concatenate[H, P], Call[T]],
) -> tuple[Callable[Concatenate[H, P], T], Callable[Concatenate[H, P], Coroutine[Any, Any, T]]]:
    """`name, aname = twins(_name)`: the blocking method and its async twin,
    both from the one operation `_name` (its parameters and docstring; the
    reply `T` of its `Call[T]`)."""

    def run(self: H, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._calls.run(op(self, *args, **kwargs))

    async def arun(self: H, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._calls.arun(op(self, *args, **kwargs))

    name = op.__name__.lstrip("_")
    for made, made_name in ((run, name), (arun, f"a{name}")):
        _present(made, op, made_name)
    return run, arun


def _present(made: Callable[..., Any], op: Callable[..., Any], name: str) -> None:
    """`made` shows as `op` does (help(), inspect.signature), named `name`,
    returning the reply of `op`'s `Call[...]` rather than the call."""
    functools.update_wrapper(made, op)
    made.__name__ = name
    made.__qualname__ = f"{op.__qualname__.rpartition('.')[0]}.{name}".lstrip(".")
    sig = inspect.signature(op)
    returns = sig.return_annotation
    if isinstance(returns, str) and (m := re.fullmatch(r"Call\[(.*)\]", returns)):
        returns = m.group(1)
    vars(made)["__signature__"] = sig.replace(return_annotation=returns)
    made.__annotations__ = {**op.__annotations__, "return": returns}
