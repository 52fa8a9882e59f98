"""Completion receipts over a multi-worker server: the results its workers hold.

Each worker's environment holds the results it finished (with shared-port
spreading any worker may have run a rollout; with rollout spreading, its
owner did), so the host asks them all and merges:

- `known`: a receipt is known if any worker holds it or acknowledged it lately;
- `ack`: all or nothing as in one process: every receipt must be known to
  some worker (`UnknownReceipt` otherwise, and no worker is asked to change
  anything), then each worker acknowledges the ones it knows;
- `collect`: every worker's held results, in capture-key order;
- the counts `status` shows come from each worker's last report, whatever
  its generation (a close or open starts a generation no one reported at yet).

Whether receipts are on is the server's configuration, not a report: each
worker says at its hello whether its server holds results (it was built with
them or not), and the pool keeps that.  Deciding it from this generation's
reports read "off" right after every close or open of admission (a restore's
resume included), refusing `ack` and collecting nothing exactly when a
restored host hands its held results out again.

`answer_receipts` is the worker's side of each operation.

A worker lost in between fails the call (`ParticipantUnavailable`, from the
channel); acknowledgements are idempotent, so the caller retries it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from ray_ckpt.errors import UnknownReceipt
from ray_ckpt.reports import Receipt
from ray_ckpt.steps.receipts import ResultReceipts, named_receipts

if TYPE_CHECKING:
    from ray_ckpt.workers.pool import WorkerPool


def _receipts(raw: Any) -> list[Receipt]:
    return msgspec.convert(raw, list[Receipt])


def answer_receipts(held: ResultReceipts | None, op: str, body: dict[str, Any]) -> dict[str, Any]:
    """A worker's answer to `receipts_known`, `receipts_ack` or `receipts_collect`
    about the results it holds (`held`: None with receipts off)."""
    if held is None:
        return {"off": True}
    if op == "receipts_collect":
        return {
            "results": [
                {"receipt": msgspec.to_builtins(h.receipt), "result": h.result}
                for h in held.collect()
            ]
        }
    receipts = _receipts(body["receipts"])
    if op == "receipts_known":
        known, unknown = held.known(receipts)
        return {"known": msgspec.to_builtins(known), "unknown": msgspec.to_builtins(unknown)}
    if op == "receipts_ack":
        now, before = held.ack(receipts)
        return {"acknowledged": msgspec.to_builtins(now), "already": msgspec.to_builtins(before)}
    raise ValueError(f"unknown receipts operation {op!r}")


class WorkerReceipts:
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def on(self) -> bool:
        """True if the workers' servers hold results (built with receipts on)."""
        return self.pool.holds_results

    def counts(self) -> tuple[int, int]:
        """(results, bytes) held across the workers, as each last reported."""
        reports = [r for r in self.pool.table.latest().values() if r.held >= 0]
        return sum(r.held for r in reports), sum(r.held_bytes for r in reports)

    async def _known_by(self, wanted: Sequence[Receipt]) -> dict[str, list[Receipt]]:
        body = {"receipts": msgspec.to_builtins(list(wanted))}
        replies = await self.pool.call_all("receipts_known", body)
        return {w: _receipts(r.get("known", [])) for w, r in replies.items()}

    async def known(self, receipts: Sequence[Receipt]) -> tuple[list[Receipt], list[Receipt]]:
        wanted = list(dict.fromkeys(receipts))
        anywhere = {r for known in (await self._known_by(wanted)).values() for r in known}
        return [r for r in wanted if r in anywhere], [r for r in wanted if r not in anywhere]

    async def ack(self, receipts: Sequence[Receipt]) -> tuple[list[Receipt], list[Receipt]]:
        """(acknowledged now, acknowledged before), as `ResultReceipts.ack`."""
        wanted = list(dict.fromkeys(receipts))
        by_worker = await self._known_by(wanted)
        anywhere = {r for known in by_worker.values() for r in known}
        unknown = [r for r in wanted if r not in anywhere]
        if unknown:
            raise UnknownReceipt(f"no result held here for receipts {named_receipts(unknown)}")
        now: set[Receipt] = set()
        before: set[Receipt] = set()
        for wid, known in sorted(by_worker.items()):
            if not known:
                continue
            reply = await self.pool.call(
                wid, "receipts_ack", {"receipts": msgspec.to_builtins(known)}
            )
            now.update(_receipts(reply["acknowledged"]))
            before.update(_receipts(reply["already"]))
        return [r for r in wanted if r in now], [r for r in wanted if r in before - now]

    async def collect(self) -> list[dict[str, Any]]:
        replies = await self.pool.call_all("receipts_collect", {})
        results = [item for r in replies.values() for item in r.get("results", [])]
        return sorted(results, key=lambda item: _receipts([item["receipt"]])[0].episode)
