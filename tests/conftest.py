"""Shared fixtures.  One real local Ray cluster per test session, started lazily.

Unit tests never touch Ray; tests that need it take the `ray_session` fixture
(tests under tests/ray and tests/e2e are marked `ray`).
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import Iterator

import pytest

# Ray binds 127.0.0.1 only with this set (loopback-only machines).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


_METRICS_PORT = _free_port()


@pytest.fixture(scope="session")
def ray_session() -> Iterator[str]:
    """Start one local Ray for the whole session; yields a unique namespace prefix."""
    import ray

    # Unix socket paths are limited to ~107 chars: keep Ray's temp dir short.
    tmp = tempfile.mkdtemp(prefix="rc", dir="/tmp")
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        _temp_dir=tmp,
        namespace="ray-ckpt-tests",
        logging_level="WARNING",
        log_to_driver=False,
        # Prometheus' endpoint on a known port (the metrics test scrapes it),
        # and reports every 2 s instead of 10 so the scrape sees them soon.
        _metrics_export_port=_METRICS_PORT,
        _system_config={"metrics_report_interval_ms": 2000},
    )
    try:
        yield f"t{uuid.uuid4().hex[:8]}"
    finally:
        ray.shutdown()


@pytest.fixture
def ray_metrics_url(ray_session: str) -> str:
    """The shared cluster's Prometheus endpoint (its one node's metrics agent)."""
    return f"http://127.0.0.1:{_METRICS_PORT}/metrics"


@pytest.fixture
def namespace(ray_session: str, request: pytest.FixtureRequest) -> str:
    """A fresh Ray namespace per test so named actors never collide."""
    return f"{ray_session}-{uuid.uuid4().hex[:8]}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "multinode: runs on the multi-node cluster (tests/multinode), after the rest"
    )
    config.addinivalue_line(
        "markers", "partitions: Ray nodes in network namespaces (tests/partitions), last of all"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A driver attaches to one Ray cluster at a time: everything on the shared
    # single-node Ray runs first, then the multi-node cluster replaces it.
    # The partition suite comes after both (its cluster runs in namespaces).
    multinode = os.sep + "multinode" + os.sep
    partitions = os.sep + "partitions" + os.sep
    for item in items:
        if multinode in str(item.path):
            item.add_marker(pytest.mark.multinode)
        if partitions in str(item.path):
            item.add_marker(pytest.mark.partitions)
    items.sort(
        key=lambda item: (
            2
            if item.get_closest_marker("partitions")
            else 1
            if item.get_closest_marker("multinode")
            else 0
        )
    )
