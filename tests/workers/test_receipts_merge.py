"""Completion receipts across a server's workers: the host's merge of what
each worker holds (`WorkerReceipts`), over each worker's real answer
(`answer_receipts` on a real `ResultReceipts`).  No processes: the channel is
a direct call here; `tests/e2e/test_demo_workers.py` runs it over real ones."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from ray_ckpt.errors import UnknownReceipt
from ray_ckpt.identity import EpisodeId
from ray_ckpt.steps.receipts import ResultReceipts
from ray_ckpt.workers.receipts import WorkerReceipts, answer_receipts
from ray_ckpt.workers.tracking import WorkerReport


class DirectPool:
    """The pool's calls, answered by each worker's own function at once."""

    def __init__(self, held: dict[str, ResultReceipts | None]) -> None:
        self.held = held
        self.table = SimpleNamespace(current=self._reports, latest=self._reports)
        self.holds_results = any(h is not None for h in held.values())

    def _reports(self) -> dict[str, WorkerReport]:
        return {
            w: WorkerReport(
                generation=0,
                ready=True,
                held=-1 if h is None else len(h),
                held_bytes=0 if h is None else h.bytes,
            )
            for w, h in self.held.items()
        }

    async def call_all(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        return {w: answer_receipts(h, op, body) for w, h in sorted(self.held.items())}

    async def call(self, wid: str, op: str, body: dict[str, Any]) -> Any:
        return answer_receipts(self.held[wid], op, body)


def two_workers() -> tuple[WorkerReceipts, dict[str, ResultReceipts | None], list[Any]]:
    w0 = ResultReceipts(max_results=10, max_bytes=1 << 20)
    w1 = ResultReceipts(max_results=10, max_bytes=1 << 20)
    r2 = w1.hold(EpisodeId("r2"), {"reward": 2})
    r1 = w0.hold(EpisodeId("r1", 1), {"reward": 1})
    held: dict[str, ResultReceipts | None] = {"w0": w0, "w1": w1}
    return WorkerReceipts(cast(Any, DirectPool(held))), held, [r1, r2]


async def test_collect_and_ack_reach_whichever_worker_holds_the_result() -> None:
    receipts, held, (r1, r2) = two_workers()
    assert receipts.on()
    assert receipts.counts()[0] == 2
    got = await receipts.collect()
    assert [item["result"] for item in got] == [{"reward": 1}, {"reward": 2}]  # by episode
    now, before = await receipts.ack([r2, r1])
    assert (now, before) == ([r2, r1], [])
    assert receipts.counts() == (0, 0)
    assert await receipts.collect() == []
    # Re-sent: each worker remembers what it freed.
    assert await receipts.ack([r1, r2]) == ([], [r1, r2])


async def test_one_unknown_receipt_refuses_the_ack_on_every_worker() -> None:
    receipts, held, (r1, r2) = two_workers()
    stray = type(r1)(rollout_id="r9", attempt=0, digest="0" * 64)
    assert await receipts.known([r1, stray, r2]) == ([r1, r2], [stray])
    with pytest.raises(UnknownReceipt, match="r9"):
        await receipts.ack([r1, r2, stray])
    assert receipts.counts()[0] == 2, "nothing was freed on any worker"


async def test_workers_without_receipts_are_off() -> None:
    receipts = WorkerReceipts(cast(Any, DirectPool({"w0": None, "w1": None})))
    assert not receipts.on()
