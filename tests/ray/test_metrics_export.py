"""Ray's Prometheus endpoint, scraped over HTTP after a real checkpoint and
restore of the reference fleet: the coordinator's and the hosts' metrics are
there, under `ray_ckpt_`, with plausible values and only low-cardinality labels."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import ray

from coordination import connect
from coordination.actor.actor_options import COORDINATOR_NAME
from participants.fleet import FleetConfig, launch_fleet
from ray_ckpt.hosting.metrics import SECONDS_BOUNDARIES
from ray_ckpt.identity import EpisodeId

pytestmark = pytest.mark.ray

SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str, workers: set[str]) -> list[tuple[str, dict[str, str], float]]:
    """Our samples from these worker processes only: the shared cluster also
    carries the metrics of every earlier test's coordinators and hosts."""
    out = []
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m["name"].startswith("ray_ckpt_"):
            labels = dict(LABEL.findall(m["labels"] or ""))
            if labels.get("WorkerId") in workers:
                out.append((m["name"], labels, float(m["value"])))
    return out


def worker_id(actor: Any) -> str:
    def own(_: Any) -> str:
        return str(ray.get_runtime_context().get_worker_id())

    return str(ray.get(actor.__ray_call__.remote(own)))


def total(found: list[tuple[str, dict[str, str], float]], name: str, **match: str) -> float | None:
    values = [
        v
        for n, labels, v in found
        if n == name and all(labels.get(k) == x for k, x in match.items())
    ]
    return sum(values) if values else None


async def scrape_until(
    url: str, workers: set[str], ready: list[tuple[Any, ...]]
) -> list[tuple[str, dict[str, str], float]]:
    """Scrape until every (name, labels[, at least]) in `ready` has samples
    summing to at least 1 (or `at least`); Ray reports every 2 s in the test
    cluster.  At most 60 s."""

    def seen(want: tuple[Any, ...]) -> bool:
        name, labels, *least = want
        return (total(found, name, **labels) or 0) >= (least[0] if least else 1)

    deadline = time.monotonic() + 60
    found: list[tuple[str, dict[str, str], float]] = []
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            async with http.get(url) as resp:
                assert resp.status == 200
                found = samples(await resp.text(), workers)
            if all(seen(w) for w in ready):
                return found
            await asyncio.sleep(1)
    missing = [w for w in ready if not seen(w)]
    raise AssertionError(
        f"not exported after 60 s: {missing}; found {sorted({f[0] for f in found})}"
    )


async def test_a_checkpoint_and_a_restore_show_up_on_rays_prometheus_endpoint(
    namespace: str, tmp_path: Path, ray_metrics_url: str
) -> None:
    fleet = await launch_fleet(FleetConfig(namespace=namespace, token="metrics-test-token"))
    try:
        gym = connect(namespace=namespace, state_dir=str(tmp_path / "state"))
        result = await gym.acheckpoint(str(tmp_path / "ck"), scope=[], trigger="periodic")
        # r1 is not in the checkpoint: it restarts, of unknown progress.
        await gym.arestore(str(tmp_path / "ck"), [EpisodeId("r1")])
        coordinator = ray.get_actor(COORDINATOR_NAME, namespace=namespace)
        workers = {worker_id(coordinator)} | {worker_id(h) for h in fleet.hosts.values()}
        found = await scrape_until(
            ray_metrics_url,
            workers,
            [
                ("ray_ckpt_checkpoints_total", {"trigger": "periodic", "outcome": "ok"}),
                ("ray_ckpt_total_save_seconds_count", {"trigger": "periodic", "outcome": "ok"}),
                ("ray_ckpt_restore_seconds_count", {"outcome": "ok"}),
                # The restart bias: the family the Grafana dashboard plots.
                ("ray_ckpt_restore_episodes_total", {"outcome": "restarted", "bucket": "unknown"}),
                # The last call of the four hosts: the resume after the restore.
                ("ray_ckpt_control_call_seconds_count", {"op": "resume", "outcome": "ok"}, 8),
            ],
        )
        # Gauges stay exported while nothing changes: Ray's exporter drops a
        # series not set again for a while (between 12 and 20 s here, with
        # 2 s report intervals, measured), so wait past it.
        await asyncio.sleep(20)
        later = await scrape_until(ray_metrics_url, workers, [])
        assert total(later, "ray_ckpt_last_checkpoint_bytes", trigger="periodic") is not None
        assert total(later, "ray_ckpt_writes_in_flight") == 0
    finally:
        await fleet.stop()
    # One checkpoint, counted once; its seconds as the coordinator measured them.
    assert total(found, "ray_ckpt_checkpoints_total", trigger="periodic", outcome="ok") == 1
    # Ray estimates a histogram's sum from its buckets, so the check is the
    # bucket: the first boundary at or above the measured seconds holds the
    # one observation (buckets are cumulative), the one below it none.
    upper = min(b for b in SECONDS_BOUNDARIES if b >= result.total_s)
    below = [b for b in SECONDS_BOUNDARIES if b < upper]

    def bucket(le: float) -> float | None:
        return total(
            found,
            "ray_ckpt_total_save_seconds_bucket",
            trigger="periodic",
            outcome="ok",
            le=str(float(le)),
        )

    assert bucket(upper) == 1
    if below:
        assert bucket(below[-1]) == 0
    assert total(found, "ray_ckpt_exclusive_hold_seconds_count", trigger="periodic") == 1
    kinds = {labels["kind"] for n, labels, _ in found if n == "ray_ckpt_commit_seconds_count"}
    assert kinds == {"environment", "model", "agent", "resources"}
    # Each of the four hosts: one prepare and commit, one restore, a resume after each.
    for op, n in (("prepare", 4), ("commit", 4), ("restore", 4), ("resume", 8)):
        assert total(found, "ray_ckpt_control_call_seconds_count", op=op, outcome="ok") == n, op
    assert total(found, "ray_ckpt_writes_in_flight") == 0
    # Low cardinality: no checkpoint ID, rollout or instance name in any label.
    for _, labels, _ in found:
        assert result.checkpoint_id not in labels.values()
        assert not any("ref-" in v for v in labels.values())


async def test_results_held_for_acknowledgement_are_a_gauge(
    namespace: str, ray_metrics_url: str
) -> None:
    """With completion receipts, the environment host samples what it holds:
    one finished result until it is acknowledged, then none."""
    from participants.rollout import make_tasks

    config = FleetConfig(namespace=namespace, token="metrics-test-token", completion_receipts=True)
    fleet = await launch_fleet(config)
    try:
        gym = connect(namespace=namespace)
        task = make_tasks(1, 1, seed=3)[0]
        body = {"episode_id": {"rollout_id": "held-1", "attempt": 0}, "task": task}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{fleet.urls['environment']}/run", json=body) as resp:
                assert resp.status == 200
                reply = await resp.json()
        env = {worker_id(fleet.hosts["environment"])}
        held = await scrape_until(
            ray_metrics_url, env, [("ray_ckpt_unacknowledged_results", {"kind": "environment"})]
        )
        assert total(held, "ray_ckpt_unacknowledged_results") == 1
        assert (total(held, "ray_ckpt_unacknowledged_bytes") or 0) > 0
        await gym.aack([reply["receipt"]])
        deadline = time.monotonic() + 60
        while total(held, "ray_ckpt_unacknowledged_results") != 0:
            assert time.monotonic() < deadline, "the gauge never went back to 0"
            await asyncio.sleep(1)
            held = await scrape_until(ray_metrics_url, env, [])
        assert total(held, "ray_ckpt_unacknowledged_bytes") == 0
    finally:
        await fleet.stop()
