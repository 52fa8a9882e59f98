"""An asynchronous checkpoint's size once durable: in `status` (which said
"size pending", or 0, until then) and in the `last_checkpoint_bytes` gauge;
its episodes counted as for a synchronous one."""

from __future__ import annotations

from collections.abc import Mapping

from coordination.engine.metrics import CoordinatorMetrics
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import make_fleet


class Gauges:
    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def record(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        self.last[name] = value


async def test_an_async_checkpoint_reports_its_bytes_once_durable() -> None:
    fleet = make_fleet()
    sink = Gauges()
    fleet.core.metrics = CoordinatorMetrics(sink)
    try:
        pending = await fleet.core.checkpoint("/ck-async", [EpisodeId("r1")], durability="async")
        assert pending.total_bytes is None  # not written when it returned
        done = await fleet.core.durable(pending.checkpoint_id)
        last = (await fleet.core.status()).last_checkpoint
        assert last is not None
        assert last.checkpoint_id == pending.checkpoint_id
        assert last.bytes == done.total_bytes == sink.last["last_checkpoint_bytes"]
        assert last.episodes == pending.episodes

        synced = await fleet.core.checkpoint("/ck-sync", [EpisodeId("r1")])
        last = (await fleet.core.status()).last_checkpoint
        assert last is not None
        assert last.bytes == synced.total_bytes == sink.last["last_checkpoint_bytes"]
        assert last.episodes == synced.episodes == pending.episodes  # counted one way
    finally:
        await fleet.aclose()
