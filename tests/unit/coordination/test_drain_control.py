"""The coordinator's drain watch: one at a time, refused bad settings, stops."""

from __future__ import annotations

from typing import Any, cast

import pytest

from coordination.actor.drain_control import DrainControl
from ray_ckpt.errors import CheckpointConflict, InvalidRequest


class Quiet:
    """No node is ever draining."""

    def draining(self) -> dict[str, float | None]:
        return {}


async def relaunch(hosts: list[str], avoid: list[str]) -> dict[str, str]:
    return {}


async def test_one_watch_at_a_time_and_stop_ends_it() -> None:
    control = DrainControl(cast(Any, object()))
    assert not control.status().running
    st = control.start("/r", relaunch, poll_s=0.01, source=Quiet())
    assert st.running
    assert st.root == "/r"
    with pytest.raises(CheckpointConflict):
        control.start("/other", relaunch, source=Quiet())
    stopped = await control.stop()
    assert not stopped.running
    assert stopped.outcomes == []
    again = control.start("/r2", relaunch, poll_s=0.01, source=Quiet())  # stopped: a new one
    assert again.root == "/r2"
    await control.stop()


@pytest.mark.parametrize(
    ("relauncher", "poll_s"), [("not callable", 1.0), (relaunch, 0.0), (relaunch, -1.0)]
)
async def test_bad_settings_are_refused_and_start_nothing(relauncher: Any, poll_s: float) -> None:
    control = DrainControl(cast(Any, object()))
    with pytest.raises(InvalidRequest):
        control.start("/r", relauncher, poll_s=poll_s, source=Quiet())
    assert not control.status().running
