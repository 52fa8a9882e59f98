"""The handle's completion-receipt calls (`CoordinatorHandle` inherits them):
`collect` every finished, unacknowledged result and `ack` the ones the
trainer's data store committed, each with its async twin
(`coordination.receipts` says what the coordinator does with them)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from coordination.receipts import AckResult, CollectResult, ReceiptLike, receipt_list


class ReceiptCalls:
    _sync: Callable[..., Any]
    _async: Callable[..., Awaitable[Any]]

    def collect(self, *, deadline_s: float | None = None) -> CollectResult:
        """Every finished, unacknowledged result (`.results`: participant,
        receipt, result), e.g. after a restore: the replies a crash lost."""
        res: CollectResult = self._sync("collect", deadline_s)
        return res

    async def acollect(self, *, deadline_s: float | None = None) -> CollectResult:
        res: CollectResult = await self._async("collect", deadline_s)
        return res

    def ack(self, receipts: Iterable[ReceiptLike], *, deadline_s: float | None = None) -> AckResult:
        """Free these results everywhere (`Receipt`s or the `receipt` dicts of
        `/run` replies); idempotent; a receipt no environment participant
        knows refuses the call (`UnknownReceipt`) and nothing is acknowledged."""
        res: AckResult = self._sync("ack", receipt_list(receipts), deadline_s)
        return res

    async def aack(
        self, receipts: Iterable[ReceiptLike], *, deadline_s: float | None = None
    ) -> AckResult:
        res: AckResult = await self._async("ack", receipt_list(receipts), deadline_s)
        return res
