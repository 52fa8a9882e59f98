"""Completion receipts across the fleet: `collect` and `ack` on the coordinator.

Every environment participant registered is asked together (other kinds
finish no episodes).  `collect` returns every finished, unacknowledged result
with its receipt and the participant holding it; a participant with receipts
off answers an empty list.  `ack` is all or nothing across the fleet: every
environment participant is first asked which of the receipts it knows (held,
or acknowledged lately: a re-sent ack stays idempotent), a receipt none knows
refuses the whole call (`UnknownReceipt`, nothing acknowledged anywhere), and
then each participant acknowledges exactly the receipts it knows.

Neither takes the coordinator's lock: they are not checkpoint phases, and a
trainer acknowledges while checkpoints come and go.  An acknowledgement that
lands after a checkpoint captured the result leaves it in that checkpoint: a
restore of it offers the result again, which is right when the trainer's own
data store is restored to the same point (its commit of the result is gone
too); a trainer that keeps its store across the restore drops re-offered
receipts it already holds.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from coordination.engine.calls import coordination_failed
from coordination.engine.fanout import Outcome, failure, fan_out
from coordination.engine.host import Host
from ray_ckpt.errors import InvalidRequest, Reason, UnknownReceipt
from ray_ckpt.reports import Receipt

if TYPE_CHECKING:
    from coordination.engine.coordinator_core import CoordinatorCore

ReceiptLike = Receipt | Mapping[str, Any]


class CollectedResult(msgspec.Struct, frozen=True, kw_only=True):
    participant: str  # the environment participant holding it, `<kind>/<name>`
    receipt: Receipt
    result: Any


class CollectResult(msgspec.Struct, frozen=True, kw_only=True):
    """Every finished, unacknowledged result, in (participant, capture key) order."""

    results: list[CollectedResult]
    seconds: float

    @property
    def receipts(self) -> list[Receipt]:
        return [r.receipt for r in self.results]


class AckResult(msgspec.Struct, frozen=True, kw_only=True):
    acknowledged: dict[str, list[Receipt]]  # participant → freed by this call
    already: list[Receipt]  # acknowledged before (a re-sent ack)
    seconds: float


def receipt_list(items: Iterable[ReceiptLike]) -> list[Receipt]:
    """Receipts from `Receipt`s or their dicts (as a `/run` reply carries them)."""
    out: list[Receipt] = []
    for item in items:
        if isinstance(item, Receipt):
            out.append(item)
            continue
        try:
            out.append(msgspec.convert(dict(item), Receipt))
        except (msgspec.ValidationError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"not a receipt: {item!r}: {exc}"[:500]) from None
    return list(dict.fromkeys(out))


def _environment(driver: CoordinatorCore) -> list[Host]:
    return [h for h in driver.hosts.values() if h.member.kind == "environment"]


def _timeout(driver: CoordinatorCore, deadline_s: float | None) -> float:
    return driver.timeouts.retire_s if deadline_s is None else deadline_s


def _raise_failures(op: str, out: Outcome) -> None:
    failures = {k: failure(e) for k, e in out.errors.items() if e.reason is not Reason.RECEIPTS_OFF}
    if failures:
        raise coordination_failed(op, "receipts", failures)


def _receipts(value: Any) -> list[Receipt]:
    return msgspec.convert(value or [], list[Receipt])


async def collect(driver: CoordinatorCore, deadline_s: float | None = None) -> CollectResult:
    start = time.monotonic()
    out = await fan_out(_environment(driver), "collect", lambda h: {}, _timeout(driver, deadline_s))
    _raise_failures("collect", out)
    results = [
        CollectedResult(
            participant=key,
            receipt=msgspec.convert(item["receipt"], Receipt),
            result=item["result"],
        )
        for key, reply in sorted(out.replies.items())
        for item in reply.get("results") or []
    ]
    return CollectResult(results=results, seconds=time.monotonic() - start)


async def ack(
    driver: CoordinatorCore, receipts: Sequence[Receipt], deadline_s: float | None = None
) -> AckResult:
    if not receipts:
        raise InvalidRequest("ack needs at least one receipt")
    start = time.monotonic()
    timeout = _timeout(driver, deadline_s)
    hosts = _environment(driver)
    wire = msgspec.to_builtins(list(receipts))
    asked = await fan_out(hosts, "ack", lambda h: {"receipts": wire, "check": True}, timeout)
    _raise_failures("ack", asked)
    known = {k: _receipts(r.get("known")) for k, r in asked.replies.items()}
    everywhere = {r for rs in known.values() for r in rs}
    unknown = [r for r in receipts if r not in everywhere]
    if unknown:
        named = ", ".join(r.key for r in unknown[:20])
        raise UnknownReceipt(
            f"no environment participant holds a result for receipts {named}"
            + (f" and {len(unknown) - 20} more" if len(unknown) > 20 else "")
            + "; nothing was acknowledged"
        )
    holders = [h for h in hosts if known.get(h.member.key)]
    done = await fan_out(
        holders,
        "ack",
        lambda h: {"receipts": msgspec.to_builtins(known[h.member.key])},
        timeout,
    )
    _raise_failures("ack", done)
    acknowledged = {k: _receipts(r.get("acknowledged")) for k, r in sorted(done.replies.items())}
    freed = {r for rs in acknowledged.values() for r in rs}
    already = [r for r in receipts if r not in freed]
    return AckResult(
        acknowledged={k: v for k, v in acknowledged.items() if v},
        already=already,
        seconds=time.monotonic() - start,
    )
