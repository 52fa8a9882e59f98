"""The finished results a participant holds (completion receipts), behind one interface.

The engine's `ack` and `collect` (and the receipt fields of `status`)
reach them through `holder`: a participant holds them itself in its
optional `receipts` hook (a `ray_ckpt.steps.receipts.ResultReceipts`,
present on an environment server with `checkpoint.completion_receipts` on),
or, on a multi-worker server, its workers hold them and the participant has
`worker_receipts` (`ray_ckpt.workers.receipts.WorkerReceipts`), which asks
every worker and merges their answers.  Both look alike from here
(`ResultHolder`).

Neither operation is a checkpoint phase: no checkpoint ID, no fencing,
allowed in every phase (a capture already taken keeps what it captured; see
docs/guide/training-loop.md on acks after a checkpoint).  A participant without either hook
answers `ack` with the typed `receipts_off` (409): an acknowledgement of a
result it never held must not pass silently.  `collect` there answers an
empty list with `"completion_receipts": false`, so a engine may collect
across a mixed fleet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ray_ckpt.control.protocol import Participant
from ray_ckpt.control.wire import to_builtins
from ray_ckpt.reports import Receipt
from ray_ckpt.steps.receipts import ResultReceipts


class ResultHolder(Protocol):
    """Whoever holds a participant's finished results, as the engine asks them."""

    def counts(self) -> tuple[int, int]:
        """How many results are held, and their bytes."""
        ...

    async def known(self, receipts: Sequence[Receipt]) -> tuple[list[Receipt], list[Receipt]]: ...

    async def ack(self, receipts: Sequence[Receipt]) -> tuple[list[Receipt], list[Receipt]]:
        """(acknowledged now, acknowledged before)."""
        ...

    async def collect(self) -> list[dict[str, Any]]:
        """Every held result, as wire dicts (`receipt`, `result`)."""
        ...


class HeldByWorkers(ResultHolder, Protocol):
    """`ray_ckpt.workers.receipts.WorkerReceipts`, as seen from here."""

    def on(self) -> bool: ...


class _HeldHere:
    """A participant's own `ResultReceipts`, as a `ResultHolder`."""

    def __init__(self, held: ResultReceipts) -> None:
        self._held = held

    def counts(self) -> tuple[int, int]:
        return len(self._held), self._held.bytes

    async def known(self, receipts: Sequence[Receipt]) -> tuple[list[Receipt], list[Receipt]]:
        return self._held.known(receipts)

    async def ack(self, receipts: Sequence[Receipt]) -> tuple[list[Receipt], list[Receipt]]:
        return self._held.ack(receipts)

    async def collect(self) -> list[dict[str, Any]]:
        return [
            {"receipt": to_builtins(h.receipt), "result": h.result} for h in self._held.collect()
        ]


def held_results(participant: Participant) -> ResultReceipts | None:
    """The participant's own held results (its `receipts` hook), if any."""
    hook = getattr(participant, "receipts", None)
    return hook if isinstance(hook, ResultReceipts) else None


def holder(participant: Participant) -> ResultHolder | None:
    """Whoever holds `participant`'s results: itself, its workers, or nobody
    (completion receipts off)."""
    held = held_results(participant)
    if held is not None:
        return _HeldHere(held)
    workers: HeldByWorkers | None = getattr(participant, "worker_receipts", None)
    return workers if workers is not None and workers.on() else None


def status_fields(held: ResultHolder | None) -> dict[str, Any]:
    """What `status` (and an ack's reply) shows of the held results."""
    if held is None:
        return {
            "completion_receipts": False,
            "unacknowledged_results": 0,
            "unacknowledged_bytes": 0,
        }
    count, size = held.counts()
    return {
        "completion_receipts": True,
        "unacknowledged_results": count,
        "unacknowledged_bytes": size,
    }
