"""The handle raises the project's own exceptions, never Ray's wrappers (real Ray)."""

from __future__ import annotations

import pathlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import ray
from ray.exceptions import RayError

from coordination import connect
from coordination.client.handle import CoordinatorHandle
from ray_ckpt.errors import (
    CheckpointConflict,
    CheckpointError,
    CoordinationFailed,
    InvalidPhase,
    InvalidRequest,
    RestartInScope,
)
from tests.ray.coord_actors import start_host

pytestmark = pytest.mark.ray


def assert_ours(err: BaseException, cls: type[CheckpointError]) -> None:
    assert type(err) is cls, type(err).__mro__
    assert not isinstance(err, RayError)
    assert isinstance(err, CheckpointError)
    assert str(err) == f"{err.code}: {err.detail}"
    assert "Traceback" not in str(err)


def sync_calls(gym: CoordinatorHandle, d: pathlib.Path) -> list[tuple[Callable[[], Any], type]]:
    return [
        (lambda: gym.commit(str(d / "c")), CheckpointConflict),
        (lambda: gym.retire_many([]), InvalidRequest),
        (lambda: gym.forget([]), InvalidRequest),
        (lambda: gym.restore(str(d / "nothing"), ["r1"]), CoordinationFailed),
        (lambda: gym.register_actor("agent", "nobody"), InvalidRequest),
        (lambda: gym.checkpoint(str(d / "s"), ["r1", "r9"], strict=True), RestartInScope),
    ]


def async_calls(
    gym: CoordinatorHandle, d: pathlib.Path
) -> list[tuple[Callable[[], Awaitable[Any]], type]]:
    return [
        (lambda: gym.acommit(str(d / "c")), CheckpointConflict),
        (lambda: gym.aretire_many([]), InvalidRequest),
        (lambda: gym.aforget([]), InvalidRequest),
        (lambda: gym.arestore(str(d / "nothing"), ["r1"]), CoordinationFailed),
        (lambda: gym.acheckpoint(str(d / "s2"), ["r1", "r9"], strict=True), RestartInScope),
    ]


async def test_every_call_raises_the_projects_own_typed_error(
    namespace: str, tmp_path: pathlib.Path
) -> None:
    host = start_host(namespace, "environment/env", live=["r1"])
    await host.status.remote()
    gym = connect(namespace=namespace, state_dir=str(tmp_path / "state"))
    try:
        for call, cls in sync_calls(gym, tmp_path):
            with pytest.raises(CheckpointError) as info:
                call()
            assert_ours(info.value, cls)
        for acall, cls in async_calls(gym, tmp_path):
            with pytest.raises(CheckpointError) as info:
                await acall()
            assert_ours(info.value, cls)

        # The structured part survives too: who failed and why.
        with pytest.raises(CoordinationFailed) as failed:
            gym.restore(str(tmp_path / "nothing"), ["r1"])
        assert failed.value.operation == "restore"
        assert failed.value.failures["gym-manifest"]["code"] == "invalid_checkpoint_state"

        # While a checkpoint is open: conflicts and phase errors, sync and async.
        gym.prepare()
        for conflict in (gym.prepare, lambda: gym.checkpoint(str(tmp_path / "x"))):
            with pytest.raises(CheckpointError) as info:
                conflict()
            assert_ours(info.value, CheckpointConflict)
        with pytest.raises(CheckpointError) as info:
            await gym.aprepare()
        assert_ours(info.value, CheckpointConflict)
        with pytest.raises(CheckpointError) as info:
            gym.retire("r1")
        assert_ours(info.value, InvalidPhase)
        with pytest.raises(CheckpointError) as info:
            await gym.aretire("r1")
        assert_ours(info.value, InvalidPhase)
        await gym.aresume()
        assert {r.phase for r in (await gym.astatus()).participants} == {"idle"}
    finally:
        ray.kill(gym.actor, no_restart=True)
        ray.kill(host, no_restart=True)
