"""The handle's completion-receipt calls (`CoordinatorHandle` inherits them):
`collect` every finished, unacknowledged result and `ack` the ones the
trainer's data store committed, each with its async twin
(`coordination.engine.receipts` says what the coordinator does with them)."""

from __future__ import annotations

from collections.abc import Iterable

from coordination.client.remote import Call, CoordinatorCalls, twins
from coordination.engine.receipts import (
    AckResult,
    CollectResult,
    ReceiptLike,
    receipt_list,
)


class ReceiptCalls:
    _calls: CoordinatorCalls

    def _collect(self, *, deadline_s: float | None = None) -> Call[CollectResult]:
        """Every finished, unacknowledged result (`.results`: participant,
        receipt, result), e.g. after a restore: the replies a crash lost."""
        return Call("collect", deadline_s)

    collect, acollect = twins(_collect)

    def _ack(
        self, receipts: Iterable[ReceiptLike], *, deadline_s: float | None = None
    ) -> Call[AckResult]:
        """Free these results everywhere (`Receipt`s or the `receipt` dicts of
        `/run` replies); idempotent; a receipt no environment participant
        knows refuses the call (`UnknownReceipt`) and nothing is acknowledged."""
        return Call("ack", receipt_list(receipts), deadline_s)

    ack, aack = twins(_ack)
