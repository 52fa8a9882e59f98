"""Completion receipts: finished results held until the trainer acknowledges them.

A result that left the Gym but never reached the trainer's data store (its
reply lost in a crash) would otherwise be neither in the trainer's data nor
restorable.  With receipts on, the environment keeps each finished result,
keyed by its episode attempt and named by a `Receipt` (rollout, attempt and
the sha256 of the result's JSON), until an acknowledgement frees it; a
checkpoint exports the held ones as records under `result:<capture key>`, a
restore installs them again (same receipts), and `collect` hands them out.

Pure bookkeeping, no I/O and no clock: the participant hooks and the
engine carry it out.  Acknowledgements are idempotent: the receipts
acknowledged last (a bounded memory, `remember`) are still known, so a re-sent
ack succeeds; one no result here ever had is refused (`UnknownReceipt`) and
the whole call changes nothing.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import orjson

from ray_ckpt.errors import InvalidCheckpointState, InvalidRequest, UnknownReceipt
from ray_ckpt.identity import EpisodeId, episode_of_result_key, result_key
from ray_ckpt.reports import Receipt
from ray_ckpt.storage.records.record import Record

DEFAULT_REMEMBER = 65_536
# How many receipts an error message names before it says "and N more".
_NAMED = 20


class Held(msgspec.Struct, frozen=True, kw_only=True):
    """One finished, unacknowledged result and its receipt."""

    receipt: Receipt
    result: Any
    size: int  # bytes of its JSON, what the byte bound counts


def encode_result(result: Any) -> bytes:
    """The result's JSON with keys sorted: what the digest and the size are of."""
    try:
        return orjson.dumps(result, option=orjson.OPT_SORT_KEYS)
    except TypeError as exc:
        raise InvalidRequest(f"a finished result must be JSON: {exc}") from None


def result_digest(result: Any) -> str:
    return hashlib.sha256(encode_result(result)).hexdigest()


def named_receipts(receipts: Sequence[Receipt]) -> str:
    keys = [r.key for r in receipts[:_NAMED]]
    more = len(receipts) - len(keys)
    return ", ".join(keys) + (f" and {more} more" if more else "")


class ResultReceipts:
    """The held results of one environment server.  Not thread-safe: one loop."""

    def __init__(
        self, *, max_results: int, max_bytes: int, remember: int = DEFAULT_REMEMBER
    ) -> None:
        if max_results <= 0 or max_bytes <= 0 or remember < 0:
            raise ValueError("receipt bounds must be positive")
        self.max_results = max_results
        self.max_bytes = max_bytes
        self.remember = remember
        self._held: dict[EpisodeId, Held] = {}
        self._bytes = 0
        # Receipts acknowledged lately, oldest first: a re-sent ack stays idempotent.
        self._acked: OrderedDict[Receipt, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    @property
    def bytes(self) -> int:
        return self._bytes

    # --- holding ------------------------------------------------------------------
    def hold(self, episode: EpisodeId, result: Any) -> Receipt:
        """Keep `episode`'s finished result; its receipt (idempotent for one result)."""
        data = encode_result(result)
        receipt = Receipt(
            rollout_id=episode.rollout_id,
            attempt=episode.attempt,
            digest=hashlib.sha256(data).hexdigest(),
        )
        self._put(Held(receipt=receipt, result=result, size=len(data)))
        return receipt

    def _put(self, held: Held) -> None:
        old = self._held.pop(held.receipt.episode, None)
        if old is not None:
            self._bytes -= old.size
        self._held[held.receipt.episode] = held
        self._bytes += held.size

    def collect(self) -> list[Held]:
        """Every held result, in capture-key order."""
        return [self._held[e] for e in sorted(self._held)]

    def blocker(self) -> str | None:
        """`unacknowledged-results:N` once a bound is passed, else None."""
        if len(self._held) > self.max_results or self._bytes > self.max_bytes:
            return f"unacknowledged-results:{len(self._held)}"
        return None

    def held_of(self, rollout_id: str) -> Receipt | None:
        """The receipt of `rollout_id`'s held result, any attempt (None: none held)."""
        for episode, held in self._held.items():
            if episode.rollout_id == rollout_id:
                return held.receipt
        return None

    # --- acknowledging ----------------------------------------------------------------
    def _is_held(self, receipt: Receipt) -> bool:
        held = self._held.get(receipt.episode)
        return held is not None and held.receipt == receipt

    def known(self, receipts: Iterable[Receipt]) -> tuple[list[Receipt], list[Receipt]]:
        """(known here: held or acknowledged lately, unknown); changes nothing."""
        known: list[Receipt] = []
        unknown: list[Receipt] = []
        for r in dict.fromkeys(receipts):
            (known if self._is_held(r) or r in self._acked else unknown).append(r)
        return known, unknown

    def ack(self, receipts: Iterable[Receipt]) -> tuple[list[Receipt], list[Receipt]]:
        """Free the results named; (acknowledged now, acknowledged before).

        All or nothing: one unknown receipt refuses the call (`UnknownReceipt`)."""
        wanted = list(dict.fromkeys(receipts))
        _, unknown = self.known(wanted)
        if unknown:
            raise UnknownReceipt(f"no result held here for receipts {named_receipts(unknown)}")
        now: list[Receipt] = []
        before: list[Receipt] = []
        for r in wanted:
            if self._is_held(r):
                self._bytes -= self._held.pop(r.episode).size
                now.append(r)
            else:
                before.append(r)
            self._remember(r)
        return now, before

    def _remember(self, receipt: Receipt) -> None:
        if self.remember == 0:
            return
        self._acked[receipt] = None
        self._acked.move_to_end(receipt)
        while len(self._acked) > self.remember:
            self._acked.popitem(last=False)

    # --- scope, retire, forget -----------------------------------------------------------
    def named_by(self, scope: Iterable[EpisodeId]) -> list[str]:
        """Capture keys of held results whose rollout `scope` names as work to resume."""
        rollouts = {e.rollout_id for e in scope}
        return sorted(e.capture_key for e in self._held if e.rollout_id in rollouts)

    def drop_retired(self, episodes: Iterable[EpisodeId]) -> list[str]:
        """Free the held results of attempts <= each episode (its rollout retired):
        the engine gave them up.  Returns their result keys."""
        upto: dict[str, int] = {}
        for e in episodes:
            upto[e.rollout_id] = max(upto.get(e.rollout_id, -1), e.attempt)
        gone = [e for e in self._held if e.attempt <= upto.get(e.rollout_id, -1)]
        for e in gone:
            self._bytes -= self._held.pop(e).size
        return sorted(result_key(e) for e in gone)

    def forget(self, rollout_ids: Iterable[str]) -> None:
        """Drop the memory of acknowledged receipts of these rollouts."""
        drop = set(rollout_ids)
        for r in [r for r in self._acked if r.rollout_id in drop]:
            del self._acked[r]

    # --- checkpoint and restore ------------------------------------------------------------
    def export(self) -> list[Record]:
        """A record per held result (its digest as version: it never changes)."""
        return [
            Record(
                result_key(h.receipt.episode),
                {"receipt": msgspec.to_builtins(h.receipt), "result": h.result},
                version=h.receipt.digest,
            )
            for h in self.collect()
        ]

    @staticmethod
    def stage(records: Sequence[Record]) -> list[Held]:
        """Validate result records (key, receipt, digest); installs nothing."""
        staged: list[Held] = []
        for record in records:
            try:
                episode = episode_of_result_key(record.key)
            except InvalidRequest as exc:
                raise InvalidCheckpointState(f"result record key: {exc.detail}") from None
            state = record.state
            if not isinstance(state, dict) or set(state) != {"receipt", "result"}:
                raise InvalidCheckpointState(f"result record {record.key}: malformed state")
            try:
                receipt = msgspec.convert(state["receipt"], Receipt)
                data = encode_result(state["result"])
            except (msgspec.ValidationError, InvalidRequest) as exc:
                raise InvalidCheckpointState(f"result record {record.key}: {exc}") from None
            if receipt.episode != episode:
                raise InvalidCheckpointState(
                    f"result record {record.key} holds the receipt of {receipt.key}"
                )
            if hashlib.sha256(data).hexdigest() != receipt.digest:
                raise InvalidCheckpointState(f"result record {record.key}: digest mismatch")
            staged.append(Held(receipt=receipt, result=state["result"], size=len(data)))
        return staged

    def install(self, staged: Iterable[Held]) -> None:
        for held in staged:
            self._put(held)
