"""The controller's `ack` and `collect` operations (completion receipts).

They act on the participant's optional `receipts` hook (a
`ray_ckpt.steps.receipts.ResultReceipts`, present on an environment server
with `checkpoint.completion_receipts` on).  Neither is a checkpoint phase:
no checkpoint ID, no fencing, allowed in every phase (a capture already
taken keeps what it captured; see the README on acks after a checkpoint).

A multi-worker server's results are held by its workers: the participant
then has `worker_receipts` (`ray_ckpt.workers.receipts.WorkerReceipts`),
which asks every worker and merges their answers.

A participant without the hook answers `ack` with the typed `receipts_off`
(409): an acknowledgement of a result it never held must not pass silently.
`collect` there answers an empty list with `"completion_receipts": false`,
so a controller may collect across a mixed fleet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ray_ckpt.control.wire import AckRequest, CollectRequest, Receipt, to_builtins
from ray_ckpt.errors import ReceiptsOff
from ray_ckpt.steps.receipts import ResultReceipts

if TYPE_CHECKING:
    from ray_ckpt.control.controller import ParticipantController


class HeldByWorkers(Protocol):
    """`ray_ckpt.workers.receipts.WorkerReceipts`, as seen from here."""

    def on(self) -> bool: ...

    def counts(self) -> tuple[int, int]: ...

    async def known(self, receipts: Sequence[Receipt]) -> tuple[list[Receipt], list[Receipt]]: ...

    async def ack(self, receipts: Sequence[Receipt]) -> tuple[list[Receipt], list[Receipt]]: ...

    async def collect(self) -> list[dict[str, Any]]: ...


def held_results(c: ParticipantController) -> ResultReceipts | None:
    hook = getattr(c.participant, "receipts", None)
    return hook if isinstance(hook, ResultReceipts) else None


def held_by_workers(c: ParticipantController) -> HeldByWorkers | None:
    hook: HeldByWorkers | None = getattr(c.participant, "worker_receipts", None)
    return hook if hook is not None and hook.on() else None


def status_fields(c: ParticipantController) -> dict[str, Any]:
    """What `status` shows of the held results."""
    held = held_results(c)
    if held is not None:
        count, size = len(held), held.bytes
    elif (workers := held_by_workers(c)) is not None:
        count, size = workers.counts()
    else:
        return {
            "completion_receipts": False,
            "unacknowledged_results": 0,
            "unacknowledged_bytes": 0,
        }
    return {
        "completion_receipts": True,
        "unacknowledged_results": count,
        "unacknowledged_bytes": size,
    }


async def ack(c: ParticipantController, req: AckRequest) -> dict[str, Any]:
    held = held_results(c)
    workers = held_by_workers(c) if held is None else None
    if held is None and workers is None:
        raise ReceiptsOff(
            f"{c.kind}/{c.instance} holds no results: completion receipts are off here"
        )
    if req.check:
        if held is not None:
            known, unknown = held.known(req.receipts)
        else:
            assert workers is not None
            known, unknown = await workers.known(req.receipts)
        return {"known": to_builtins(known), "unknown": to_builtins(unknown)}
    if held is not None:
        now, before = held.ack(req.receipts)
    else:
        assert workers is not None
        now, before = await workers.ack(req.receipts)
    if now:
        c.notify()  # a prepare waiting below the bound may be ready now
    return {
        "acknowledged": to_builtins(now),
        "already": to_builtins(before),
        **status_fields(c),
    }


async def collect(c: ParticipantController, _req: CollectRequest) -> dict[str, Any]:
    held = held_results(c)
    if held is not None:
        results = [{"receipt": to_builtins(h.receipt), "result": h.result} for h in held.collect()]
    elif (workers := held_by_workers(c)) is not None:
        results = await workers.collect()
    else:
        results = []
    return {"results": results, **status_fields(c)}
