"""The controller's `ack` and `collect` operations (completion receipts).

They act on the participant's optional `receipts` hook (a
`ray_ckpt.steps.receipts.ResultReceipts`, present on an environment server
with `checkpoint.completion_receipts` on).  Neither is a checkpoint phase:
no checkpoint ID, no fencing, allowed in every phase (a capture already
taken keeps what it captured; see the README on acks after a checkpoint).

A participant without the hook answers `ack` with the typed `receipts_off`
(409): an acknowledgement of a result it never held must not pass silently.
`collect` there answers an empty list with `"completion_receipts": false`,
so a controller may collect across a mixed fleet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray_ckpt.control.wire import AckRequest, CollectRequest, to_builtins
from ray_ckpt.errors import ReceiptsOff
from ray_ckpt.steps.receipts import ResultReceipts

if TYPE_CHECKING:
    from ray_ckpt.control.controller import ParticipantController


def held_results(c: ParticipantController) -> ResultReceipts | None:
    hook = getattr(c.participant, "receipts", None)
    return hook if isinstance(hook, ResultReceipts) else None


def status_fields(c: ParticipantController) -> dict[str, Any]:
    """What `status` shows of the held results."""
    held = held_results(c)
    return {
        "completion_receipts": held is not None,
        "unacknowledged_results": 0 if held is None else len(held),
        "unacknowledged_bytes": 0 if held is None else held.bytes,
    }


async def ack(c: ParticipantController, req: AckRequest) -> dict[str, Any]:
    held = held_results(c)
    if held is None:
        raise ReceiptsOff(
            f"{c.kind}/{c.instance} holds no results: completion receipts are off here"
        )
    if req.check:
        known, unknown = held.known(req.receipts)
        return {"known": to_builtins(known), "unknown": to_builtins(unknown)}
    now, before = held.ack(req.receipts)
    if now:
        c.notify()  # a prepare waiting below the bound may be ready now
    return {
        "acknowledged": to_builtins(now),
        "already": to_builtins(before),
        **status_fields(c),
    }


async def collect(c: ParticipantController, _req: CollectRequest) -> dict[str, Any]:
    held = held_results(c)
    results = [] if held is None else held.collect()
    return {
        "results": [{"receipt": to_builtins(h.receipt), "result": h.result} for h in results],
        **status_fields(c),
    }
