"""Completion receipts, the pure part: holding, acknowledging, bounds, records."""

from __future__ import annotations

import hashlib

import msgspec
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_ckpt.control.wire import decode_receipt_request
from ray_ckpt.errors import InvalidCheckpointState, InvalidRequest, UnknownReceipt
from ray_ckpt.identity import EpisodeId, check_record_key, result_key
from ray_ckpt.reports import Receipt
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.steps.receipts import ResultReceipts, result_digest
from ray_ckpt.storage.records.record import Record

R1 = {"task_id": "t1", "reward": 1.0, "steps": [1, 2]}
R2 = {"task_id": "t2", "reward": 0.0, "steps": []}


def held(max_results: int = 10, max_bytes: int = 10_000, remember: int = 100) -> ResultReceipts:
    return ResultReceipts(max_results=max_results, max_bytes=max_bytes, remember=remember)


def test_hold_names_the_result_by_episode_and_digest_of_its_sorted_json() -> None:
    h = held()
    receipt = h.hold(EpisodeId("r1", 2), R1)
    data = orjson.dumps(R1, option=orjson.OPT_SORT_KEYS)
    assert receipt == Receipt(rollout_id="r1", attempt=2, digest=hashlib.sha256(data).hexdigest())
    assert result_digest({"steps": [1, 2], "reward": 1.0, "task_id": "t1"}) == receipt.digest
    assert (len(h), h.bytes) == (1, len(data))
    assert [(x.receipt, x.result) for x in h.collect()] == [(receipt, R1)]


def test_ack_frees_once_and_a_re_ack_is_idempotent() -> None:
    h = held()
    a = h.hold(EpisodeId("r1"), R1)
    b = h.hold(EpisodeId("r2"), R2)
    assert h.ack([a]) == ([a], [])
    assert [x.receipt for x in h.collect()] == [b]
    assert h.ack([a, b]) == ([b], [a])
    assert (len(h), h.bytes) == (0, 0)
    assert h.ack([a, b]) == ([], [a, b])


def test_an_unknown_receipt_refuses_the_whole_ack_and_changes_nothing() -> None:
    h = held()
    a = h.hold(EpisodeId("r1"), R1)
    wrong_digest = Receipt(rollout_id="r1", attempt=0, digest="0" * 64)
    other_attempt = Receipt(rollout_id="r1", attempt=1, digest=a.digest)
    for bad in (wrong_digest, other_attempt):
        with pytest.raises(UnknownReceipt) as err:
            h.ack([a, bad])
        assert err.value.code == "unknown_receipt"
        assert bad.key in err.value.detail
        assert [x.receipt for x in h.collect()] == [a]
    assert h.known([a, wrong_digest]) == ([a], [wrong_digest])


def test_the_acknowledged_memory_is_bounded_and_forget_drops_it() -> None:
    h = held(remember=2)
    receipts = [h.hold(EpisodeId(f"r{i}"), {"i": i}) for i in range(3)]
    h.ack(receipts)
    # The oldest acknowledgement is forgotten: re-acking it is now unknown.
    assert h.known(receipts) == (receipts[1:], receipts[:1])
    h.forget(["r2"])
    assert h.known(receipts[1:]) == ([receipts[1]], [receipts[2]])


def test_past_either_bound_the_blocker_names_the_count() -> None:
    h = held(max_results=2, max_bytes=10_000)
    for i in range(2):
        h.hold(EpisodeId(f"r{i}"), {"i": i})
    assert h.blocker() is None
    last = h.hold(EpisodeId("r9"), {"i": 9})
    assert h.blocker() == "unacknowledged-results:3"
    h.ack([last])
    assert h.blocker() is None
    small = held(max_results=100, max_bytes=20)
    small.hold(EpisodeId("r1"), {"text": "x" * 30})
    assert small.blocker() == "unacknowledged-results:1"


def test_scope_check_retire_and_hold_replacing_the_same_attempt() -> None:
    h = held()
    h.hold(EpisodeId("r1", 1), R1)
    h.hold(EpisodeId("r2"), R2)
    assert h.named_by([EpisodeId("r1", 2), EpisodeId("r3")]) == ["r1-a1"]
    assert h.named_by([]) == []
    assert h.drop_retired([EpisodeId("r1", 0)]) == []  # attempt 1 is newer
    assert h.drop_retired([EpisodeId("r1", 1)]) == [result_key(EpisodeId("r1", 1))]
    again = h.hold(EpisodeId("r2"), R1)  # the same attempt holds one result
    assert [x.receipt for x in h.collect()] == [again]
    assert h.bytes == len(orjson.dumps(R1, option=orjson.OPT_SORT_KEYS))


def test_records_round_trip_and_tampered_records_are_refused() -> None:
    h = held()
    a = h.hold(EpisodeId("r1", 1), R1)
    records = h.export()
    assert [(r.key, r.version) for r in records] == [("result:r1-a1", a.digest)]
    assert check_record_key(records[0].key) == EpisodeId("r1", 1)
    fresh = held()
    fresh.install(ResultReceipts.stage(records))
    assert [(x.receipt, x.result) for x in fresh.collect()] == [(a, R1)]

    state = records[0].state
    bad = [
        Record("r1-a1", state),  # not a result key
        Record("result:r2", state),  # the receipt of another episode
        Record("result:r1-a1", {**state, "result": R2}),  # digest mismatch
        Record("result:r1-a1", {"receipt": state["receipt"]}),
        Record("result:r1-a1", {**state, "receipt": {"rollout_id": "r1"}}),
    ]
    for record in bad:
        with pytest.raises(InvalidCheckpointState):
            ResultReceipts.stage([records[0], record])


def test_wire_ack_body_is_validated() -> None:
    ok = {"receipts": [{"rollout_id": "r1", "attempt": 0, "digest": "a" * 64}]}
    assert decode_receipt_request("ack", orjson.dumps(ok)).receipts[0].rollout_id == "r1"
    assert decode_receipt_request("collect", b"{}") is not None
    for body in (
        {"receipts": []},
        {"receipts": [{"rollout_id": "r1", "digest": "A" * 64}]},
        {"receipts": [{"rollout_id": "r1-a2", "digest": "a" * 64}]},
        {"receipts": [{"rollout_id": "r1", "attempt": -1, "digest": "a" * 64}]},
        {**ok, "extra": 1},
    ):
        with pytest.raises(InvalidRequest):
            decode_receipt_request("ack", orjson.dumps(body))
    with pytest.raises(InvalidRequest):
        decode_receipt_request("collect", b'{"x": 1}')


def test_settings_default_off_with_positive_bounds() -> None:
    s = CheckpointSettings()
    assert s.completion_receipts is False
    assert s.max_unacknowledged_results > 0
    assert s.max_unacknowledged_bytes > 0
    with pytest.raises(ValueError, match="greater than 0"):
        CheckpointSettings(max_unacknowledged_results=0)
    assert msgspec.to_builtins(Receipt(rollout_id="r", digest="b" * 64)) == {
        "rollout_id": "r",
        "attempt": 0,
        "digest": "b" * 64,
    }


# --- property: random hold/ack/retire sequences against a small model ---------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["hold", "ack", "ack_stray", "retire"]),
        st.integers(0, 3),  # rollout
        st.integers(0, 2),  # attempt
        st.integers(0, 5),  # result value
    ),
    max_size=40,
)


@given(OPS)
@settings(max_examples=150, deadline=None)
def test_random_sequences_match_a_model(ops: list[tuple[str, int, int, int]]) -> None:
    h = held(remember=1000)
    model: dict[EpisodeId, Receipt] = {}
    sizes: dict[EpisodeId, int] = {}
    acked: set[Receipt] = set()
    for op, r, a, v in ops:
        eid = EpisodeId(f"r{r}", a)
        if op == "hold":
            receipt = h.hold(eid, {"v": v})
            model[eid] = receipt
            sizes[eid] = len(orjson.dumps({"v": v}))
        elif op == "ack" and eid in model:
            receipt = model.pop(eid)
            sizes.pop(eid)
            assert h.ack([receipt]) == ([receipt], [])
            acked.add(receipt)
        elif op == "ack_stray":
            stray = Receipt(rollout_id=f"r{r}", attempt=a, digest=f"{v:064x}")
            before = h.collect()
            if stray in acked:
                h.ack([stray])
            else:
                with pytest.raises(UnknownReceipt):
                    h.ack([*model.values(), stray])
            assert h.collect() == before  # a refused ack changed nothing
        elif op == "retire":
            gone = {e for e in model if e.rollout_id == eid.rollout_id and e.attempt <= a}
            assert h.drop_retired([eid]) == sorted(result_key(e) for e in gone)
            for e in gone:
                model.pop(e)
                sizes.pop(e)
        assert [x.receipt for x in h.collect()] == [model[e] for e in sorted(model)]
        assert (len(h), h.bytes) == (len(model), sum(sizes.values()))
    assert h.ack(list(model.values()))[0] == list(model.values())
    assert h.bytes == 0
