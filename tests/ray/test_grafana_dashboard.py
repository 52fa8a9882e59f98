"""The shipped Grafana dashboard reads metrics that really exist: Ray's
Prometheus endpoint of the shared cluster is scraped after a small real run
(a checkpoint, a restore that restarts an episode, a checkpoint of an episode
in flight, a refused restore), and every metric a dashboard query names must
have been exported by this run's coordinator and hosts, with every label the
query filters or groups on."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from pathlib import Path

import aiohttp
import pytest
import ray

from coordination import connect
from coordination.actor.actor_options import COORDINATOR_NAME
from coordination.actor.grafana_dashboard import dashboard, metric_names, queries
from coordination.engine.metrics import DEFINITIONS
from participants.fleet import FleetConfig, launch_fleet
from participants.rollout import make_tasks, run_episode
from ray_ckpt.errors import ParticipantNotFresh
from ray_ckpt.identity import EpisodeId
from tests.ray.test_metrics_export import LABEL, SAMPLE, worker_id

pytestmark = pytest.mark.ray

# Metrics the dashboard shows before the code defines them, each with the
# `coordination.engine.metrics.DEFINITIONS` key that defines it.  Until then
# the test ends as xfail naming them (never a silent pass); once defined, they
# are checked like every other.
PENDING = {"ray_ckpt_restore_episodes_total": "restore_episodes"}
# Set by Prometheus' scrape configuration (KubeRay), not by Ray: absent here.
NOT_FROM_RAY = {"ray_io_cluster"}
MATCHER = re.compile(r'(\w+)\s*(?:=~|!~|!=|=)\s*"')
BY = re.compile(r"\bby\s*\(([^)]*)\)")
LABEL_VALUES = re.compile(r"label_values\((\w+)(?:\{[^}]*\})?,\s*(\w+)\)")


def labels_of(query: str) -> set[str]:
    """The labels a query filters on, groups by or lists."""
    found = set(MATCHER.findall(query))
    for group in BY.findall(query):
        found |= {g.strip() for g in group.split(",") if g.strip()}
    found |= {label for _, label in LABEL_VALUES.findall(query)}
    return found - NOT_FROM_RAY


class Scrapes:
    """Every `ray_ckpt_` metric name and its labels, by the worker that
    exported it, over every scrape so far: seen once counts, because a gauge
    not set again ages out of the endpoint after two report intervals (Ray's
    gauge TTL), so scraping starts with the run, not after it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.by_worker: dict[str, dict[str, set[str]]] = {}

    async def scrape(self, http: aiohttp.ClientSession) -> None:
        async with http.get(self.url) as resp:
            assert resp.status == 200
            text = await resp.text()
        for line in text.splitlines():
            m = SAMPLE.match(line)
            if m and m["name"].startswith("ray_ckpt_"):
                labels = dict(LABEL.findall(m["labels"] or ""))
                names = self.by_worker.setdefault(labels.get("WorkerId", ""), {})
                names.setdefault(m["name"], set()).update(labels)

    def seen(self, workers: set[str]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for worker in workers:
            for name, labels in self.by_worker.get(worker, {}).items():
                out.setdefault(name, set()).update(labels)
        return out

    async def run(self) -> None:
        """Scrape every second until cancelled (Ray reports every 2 s here)."""
        async with aiohttp.ClientSession() as http:
            while True:
                await self.scrape(http)
                await asyncio.sleep(1)

    async def until(self, workers: set[str], wanted: set[str]) -> dict[str, set[str]]:
        """Go on until every wanted name was seen from `workers`; at most 60 s."""
        deadline = time.monotonic() + 60
        async with aiohttp.ClientSession() as http:
            while not wanted <= set(self.seen(workers)) and time.monotonic() < deadline:
                await asyncio.sleep(1)
                await self.scrape(http)
        return self.seen(workers)


async def test_every_dashboard_query_names_an_exported_metric(
    namespace: str, tmp_path: Path, ray_metrics_url: str
) -> None:
    board = dashboard()
    wanted = {n for q in queries(board) for n in metric_names(q)}
    pending = {n for n, key in PENDING.items() if key not in DEFINITIONS}
    config = FleetConfig(
        namespace=namespace,
        token="grafana-test-token",
        completion_receipts=True,  # the held-results gauges
        step_delay_s=0.3,
        suffix="grafana",
    )
    fleet = await launch_fleet(config)
    scrapes = Scrapes(ray_metrics_url)
    scraping = asyncio.create_task(scrapes.run())
    try:
        gym = connect(namespace=namespace, state_dir=str(tmp_path / "state"))
        empty = str(tmp_path / "ck-empty")
        await gym.acheckpoint(empty, scope=[], trigger="periodic")
        # Fresh processes: restored, and "gone" restarts (the restart bias).
        await gym.arestore(empty, [EpisodeId("gone")])
        async with aiohttp.ClientSession() as http:
            env_url = fleet.urls["environment"]
            task = make_tasks(1, steps=2, seed=5)[0]
            run = asyncio.create_task(run_episode(http, env_url, EpisodeId("r0"), task))
            try:
                async with asyncio.timeout(30):  # under way
                    while True:
                        async with http.get(env_url + "/stats") as resp:
                            if (await resp.json())["live_episodes"] == 1:
                                break
                        await asyncio.sleep(0.01)
                live = str(tmp_path / "ck-live")
                done = await gym.acheckpoint(live, [EpisodeId("r0")])
                assert done.continued == ["r0"]
                # These processes served: refused (a failure, by phase and code).
                with pytest.raises(ParticipantNotFresh):
                    await gym.arestore(live)
                async with asyncio.timeout(60):
                    assert "result" in await run
            finally:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
        coordinator = ray.get_actor(COORDINATOR_NAME, namespace=namespace)
        workers = {worker_id(coordinator)} | {worker_id(h) for h in fleet.hosts.values()}
        seen = await scrapes.until(workers, wanted - pending)
    finally:
        scraping.cancel()
        await asyncio.gather(scraping, return_exceptions=True)
        with contextlib.suppress(ValueError):  # the coordinator connect() made
            ray.kill(ray.get_actor(COORDINATOR_NAME, namespace=namespace), no_restart=True)
        await fleet.stop(timeout_s=10)
    missing = sorted(wanted - pending - set(seen))
    assert not missing, f"queried but never exported: {missing}; exported: {sorted(seen)}"
    for query in queries(board):
        for name in metric_names(query) - pending:
            unknown = labels_of(query) - seen[name]
            assert not unknown, f"{name} has no label {sorted(unknown)} (query: {query})"
    if pending:
        pytest.xfail(f"pending: the dashboard queries {sorted(pending)}, not defined yet")
