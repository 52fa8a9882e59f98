"""The main job with two worker processes per Gym server (`--workers 2`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordination.demo import DemoOptions, run_demo
from coordination.demo.report import Ui

pytestmark = [pytest.mark.ray]


@pytest.mark.parametrize("restore_workers", [2, 3])
async def test_demo_with_two_workers_per_server_continues_every_rollout(
    namespace: str, tmp_path: Path, restore_workers: int
) -> None:
    """2 -> 2 is `ray-ckpt demo --workers 2`; 2 -> 3 restores every episode
    into the worker its rollout routes to among three."""
    opts = DemoOptions(
        address=None,
        namespace=namespace,
        rollouts=4,
        steps=2,
        seed=5,
        checkpoint_dir=str(tmp_path / "ckpt"),
        token_delay_s=0.04,
        step_delay_s=0.1,
        verify_delay_s=0.15,
        stagger_s=0.2,
        workers=2,
        restore_workers=restore_workers,
    )
    report = await run_demo(opts, Ui())
    summary = report.summary()
    assert summary["ok"] is True, summary["problems"]
    assert summary["equal"] is True
    assert summary["lost"] == []
    assert summary["different"] == []
    assert summary["episodes_in_flight_at_checkpoint"] > 0
    assert summary["episodes_restarted"] == 0
    # Completion receipts across workers: after the restore into another
    # worker count the driver collects from every worker; a reply it lost is
    # recovered there (the merge itself: tests/workers/test_receipts_merge.py).
    assert summary["completion_receipts"] is True
    assert summary["results_recovered_by_receipt"] == summary["replies_lost"]
    assert summary["workers"] == 2
    assert summary["restore_workers"] == restore_workers
    # Every server, the environment included, ran two live workers.
    assert summary["workers_serving"] == {
        "environment": 2,
        "model": 2,
        "agent": 2,
        "resources": 2,
    }
