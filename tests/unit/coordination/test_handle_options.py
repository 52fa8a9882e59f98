"""The checkpoint's options as one `CheckpointOptions`, from the handle to the
engine: the handle builds it (or takes one), the actor and its periodic loop
pass it on, the engine checks it once.  No Ray: the handle's async twin over
an in-process stand-in for the actor, and the `Coordinator` class in-process
over a fleet of in-process participants."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from coordination.actor.coordinator import Coordinator
from coordination.client.handle import CoordinatorHandle
from coordination.client.pending import PendingCheckpoint
from coordination.engine.options import CheckpointOptions
from coordination.engine.results import CheckpointResult
from ray_ckpt.errors import InvalidRequest, ParticipantUnavailable, RestartInScope
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import Fleet, make_fleet

SCOPE = [EpisodeId("r1")]


def reply(*, pending: bool = False) -> CheckpointResult:
    return CheckpointResult(
        checkpoint_id="ckpt-1",
        checkpoint_dir="/ck/1",
        total_s=0.0,
        prepare_s=0.0,
        commit_s=0.0,
        manifest_s=0.0,
        resume_s=0.0,
        timings={},
        bytes={},
        total_bytes=None,
        episode_ids={},
        restarts={},
        pending=pending,
    )


class Method:
    def __init__(self, actor: Actor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        self.actor.sent.append((self.name, args, kwargs))
        answer = self.actor.answers.get(self.name)

        async def reply() -> Any:
            if isinstance(answer, BaseException):
                raise answer
            return answer

        return asyncio.ensure_future(reply())


class Actor:
    """The coordinator actor as the handle sees it: `actor.<method>.remote(...)`
    returning something to await; records what was sent."""

    def __init__(self, **answers: Any) -> None:
        self.answers = answers
        self.sent: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Method:
        return Method(self, name)


async def test_the_keywords_travel_as_one_checkpoint_options() -> None:
    actor = Actor(checkpoint=reply())
    gym = CoordinatorHandle(actor, "ns")
    res = await gym.acheckpoint(
        "/ck/1", ["r1", ("r2", 1)], resume=False, stop=True, prepare_s=2.0, trigger="drain"
    )
    assert res == reply()
    assert actor.sent == [
        (
            "checkpoint",
            (
                CheckpointOptions(
                    checkpoint_dir="/ck/1",
                    scope=[EpisodeId("r1"), EpisodeId("r2", 1)],
                    resume=False,
                    stop=True,
                    prepare_s=2.0,
                    trigger="drain",
                ),
            ),
            {},
        )
    ]


async def test_one_options_struct_is_sent_as_given() -> None:
    actor = Actor(checkpoint=reply())
    gym = CoordinatorHandle(actor, "ns")
    asked = CheckpointOptions(checkpoint_dir="/ck/1", scope=SCOPE, strict=True, total_s=5.0)
    await gym.acheckpoint(asked)
    assert actor.sent == [("checkpoint", (asked,), {})]


@pytest.mark.parametrize(
    ("extra", "passed"),
    [
        ({"scope": ["r1"]}, {"scope": [EpisodeId("r1")]}),
        ({"stop": True}, {"stop": True}),
        ({"durability": "async"}, {"durability": "async"}),
    ],
)
async def test_keywords_beside_the_options_go_on_to_the_engine_to_judge(
    extra: dict[str, Any], passed: dict[str, Any]
) -> None:
    # The handle restates no rule: it passes the struct and what was given
    # beside it; the engine refuses the pair (the actor test below).
    actor = Actor(checkpoint=reply())
    gym = CoordinatorHandle(actor, "ns")
    asked = CheckpointOptions(checkpoint_dir="/ck/1")
    await gym.acheckpoint(asked, **extra)
    assert actor.sent == [("checkpoint", (asked,), passed)]


async def test_the_handle_leaves_the_checking_to_the_engine() -> None:
    # The coordinator's refusal arrives as itself; the handle restated no rule.
    refusal = InvalidRequest("strict and stop cannot be combined")
    actor = Actor(checkpoint=refusal)
    gym = CoordinatorHandle(actor, "ns")
    with pytest.raises(InvalidRequest) as err:
        await gym.acheckpoint("/ck/1", strict=True, stop=True)
    assert err.value is refusal
    ((_, (sent,), _),) = actor.sent
    assert sent.strict
    assert sent.stop


async def test_an_async_checkpoint_comes_back_pending_on_its_durable_call() -> None:
    actor = Actor(checkpoint=reply(pending=True))
    gym = CoordinatorHandle(actor, "ns")
    pending = await gym.acheckpoint("/ck/1", durability="async")
    assert isinstance(pending, PendingCheckpoint)
    assert pending.checkpoint_id == "ckpt-1"
    assert [(m, a) for m, a, _ in actor.sent] == [
        ("checkpoint", (CheckpointOptions(checkpoint_dir="/ck/1", durability="async"),)),
        ("durable", ("ckpt-1",)),
    ]


async def test_a_failed_call_is_a_typed_error_naming_the_method() -> None:
    gym = CoordinatorHandle(Actor(status=RuntimeError("boom")), "ns")
    with pytest.raises(ParticipantUnavailable, match="coordinator status"):
        await gym.astatus()


async def test_a_local_operation_runs_here(tmp_path: Path) -> None:
    actor = Actor()
    gym = CoordinatorHandle(actor, "ns")
    assert await gym.alist_checkpoints(str(tmp_path)) == []
    assert gym.list_checkpoints(str(tmp_path)) == []
    assert actor.sent == []


# --- the actor passes the struct on -------------------------------------------------


@pytest.fixture
async def actor(tmp_path: Path) -> AsyncIterator[tuple[Coordinator, Fleet]]:
    fleet = make_fleet()
    coordinator = Coordinator("ns", state_dir=str(tmp_path / "state"), auto_discover=False)
    coordinator.core = fleet.core  # in-process participants instead of Ray actors
    yield coordinator, fleet
    await fleet.aclose()


async def test_the_actor_runs_the_options_it_is_given(
    actor: tuple[Coordinator, Fleet], tmp_path: Path
) -> None:
    coordinator, fleet = actor
    where = str(tmp_path / "ck")
    res = await coordinator.checkpoint(
        CheckpointOptions(checkpoint_dir=where, scope=SCOPE, resume=False, trigger="signal")
    )
    assert res.checkpoint_dir == where
    assert res.resume_s is None  # resume=False: left open to publish
    assert fleet.core.open is not None
    await coordinator.resume()
    assert (await coordinator.timeline())["otherData"]["trigger"] == "signal"


async def test_the_engine_checks_the_options_once_before_anyone_is_paused(
    actor: tuple[Coordinator, Fleet], tmp_path: Path
) -> None:
    coordinator, fleet = actor
    asked = CheckpointOptions(checkpoint_dir=str(tmp_path / "ck"), strict=True, stop=True)
    with pytest.raises(InvalidRequest, match="strict and stop"):
        await coordinator.checkpoint(asked)
    assert fleet.events("prepare") == []


@pytest.mark.parametrize("extra", [{"scope": SCOPE}, {"stop": True}, {"durability": "async"}])
async def test_options_and_keywords_together_are_refused_before_anyone_is_paused(
    actor: tuple[Coordinator, Fleet], tmp_path: Path, extra: dict[str, Any]
) -> None:
    coordinator, fleet = actor
    asked = CheckpointOptions(checkpoint_dir=str(tmp_path / "ck"))
    with pytest.raises(InvalidRequest, match="not both"):
        await coordinator.checkpoint(asked, **extra)
    assert fleet.events("prepare") == []
    assert fleet.core.open is None


async def test_the_actor_takes_a_directory_alone(
    actor: tuple[Coordinator, Fleet], tmp_path: Path
) -> None:
    coordinator, fleet = actor
    # Every episode the participants export: none in flight here, so no restarts.
    res = await coordinator.checkpoint(str(tmp_path / "ck"))
    assert res.resume_s is not None
    assert [m[0] for m in fleet.manifests] == [str(tmp_path / "ck")]


async def test_the_periodic_loop_checkpoints_as_periodic(
    actor: tuple[Coordinator, Fleet], tmp_path: Path
) -> None:
    coordinator, fleet = actor
    where = str(tmp_path / "ckpt-1")
    await coordinator._periodic_checkpoint(str(tmp_path), where)
    assert [m[0] for m in fleet.manifests] == [where]
    assert (await coordinator.timeline())["otherData"]["trigger"] == "periodic"


async def test_a_strict_checkpoint_through_the_actor_refuses_a_restart(
    actor: tuple[Coordinator, Fleet], tmp_path: Path
) -> None:
    coordinator, fleet = actor
    asked = CheckpointOptions(
        checkpoint_dir=str(tmp_path / "ck"), scope=[EpisodeId("nowhere")], strict=True
    )
    with pytest.raises(RestartInScope):
        await coordinator.checkpoint(asked)
    assert fleet.manifests == []
