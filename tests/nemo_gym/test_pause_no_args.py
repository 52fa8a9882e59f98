"""The coordinator pauses actors whose pause/resume take no arguments (NeMo RL's
`AsyncTrajectoryCollector`), without Ray: a stand-in handle binds calls the way
a Ray actor method does (a `TypeError` at `.remote()`, before anything runs)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import pytest

from coordination.engine.pause import ControllerPauses
from coordination.engine.results import Timeouts
from coordination.reach.hosts import RayPauseTarget
from ray_ckpt.errors import CoordinationFailed


class _Method:
    def __init__(self, fn: Callable[..., Any], calls: list[tuple[str, tuple[Any, ...]]]) -> None:
        self.fn = fn
        self.calls = calls

    def remote(self, *args: Any) -> asyncio.Future[Any]:
        inspect.signature(self.fn).bind(*args)  # TypeError here, as Ray's binding does
        self.calls.append((self.fn.__name__, args))
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(self.fn(*args))
        return done


class Handle:
    """Methods shaped like the real actors' (only the signature matters)."""

    def __init__(self, pause: Callable[..., Any], resume: Callable[..., Any]) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.pause = _Method(pause, self.calls)
        self.resume = _Method(resume, self.calls)


def collector_pause() -> None: ...


def collector_resume() -> None: ...


def ours_pause(checkpoint_id: str, deadline_s: float) -> dict[str, int]:
    return {"in_flight": 0}


def ours_resume(checkpoint_id: str) -> dict[str, bool]:
    return {"resumed": True}


def one_arg(x: int, y: int, z: int) -> None: ...


async def test_argument_less_pause_and_resume_are_called_without_arguments() -> None:
    handle = Handle(pause=collector_pause, resume=collector_resume)
    pauses = ControllerPauses(Timeouts())
    pauses.register(RayPauseTarget("assembler", handle))  # the default: pass_args=True
    for cid in ("c1", "c2"):
        await pauses.pause(cid, ["assembler"], 5.0)
        assert await pauses.unpause(cid) == {}
    # Never called with arguments (the refused bindings ran nothing).
    assert handle.calls == [("collector_pause", ()), ("collector_resume", ())] * 2


async def test_methods_that_take_our_arguments_still_get_them() -> None:
    handle = Handle(pause=ours_pause, resume=ours_resume)
    pauses = ControllerPauses(Timeouts())
    pauses.register(RayPauseTarget("trainer", handle))
    await pauses.pause("c1", ["trainer"], 5.0)
    assert await pauses.unpause("c1") == {}
    assert handle.calls == [("ours_pause", ("c1", 5.0)), ("ours_resume", ("c1",))]


async def test_methods_that_take_neither_are_a_typed_refusal() -> None:
    handle = Handle(pause=one_arg, resume=one_arg)
    pauses = ControllerPauses(Timeouts())
    pauses.register(RayPauseTarget("assembler", handle))
    with pytest.raises(CoordinationFailed) as caught:
        await pauses.pause("c1", ["assembler"], 5.0)
    assert caught.value.failures["assembler"]["code"] == "invalid_request"
    failures = await pauses.unpause("c1")
    assert failures["assembler"]["code"] == "invalid_request"
    assert handle.calls == []
