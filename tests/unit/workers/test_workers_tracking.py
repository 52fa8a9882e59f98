"""The pure worker table: generations, stale reports, named blockers, silence."""

from __future__ import annotations

from ray_ckpt.clock import ManualClock
from ray_ckpt.workers.tracking import WorkerReport, WorkerTable


def _table(n: int = 2) -> tuple[WorkerTable, ManualClock, dict[str, int]]:
    clock = ManualClock()
    table = WorkerTable(n, clock, silence_s=5.0)
    incs = {f"w{i}": table.join(f"w{i}", 100 + i) for i in range(n)}
    return table, clock, incs


def test_ready_needs_every_worker_to_report_ready_at_the_close_generation() -> None:
    table, _, inc = _table()
    assert not table.ready()  # open: never ready
    gen = table.close()
    assert table.blockers() == ["workers-unreported:2"]
    assert table.report("w0", inc["w0"], WorkerReport(generation=gen, ready=True))
    assert table.blockers() == ["workers-unreported:1"]
    assert not table.ready()
    assert table.report("w1", inc["w1"], WorkerReport(generation=gen, ready=False))
    assert table.blockers() == []
    assert not table.ready()  # reported, but busy
    assert table.report("w1", inc["w1"], WorkerReport(generation=gen, ready=True))
    assert table.ready()


def test_a_report_from_before_the_latest_close_is_discarded() -> None:
    table, _, inc = _table()
    first = table.close()
    table.open()
    second = table.close()
    assert second > first
    # Sent ready before it saw the second close: must not count.
    assert not table.report("w0", inc["w0"], WorkerReport(generation=first, ready=True))
    assert not table.report("w0", inc["w0"], WorkerReport(generation=second - 1, ready=True))
    assert table.blockers() == ["workers-unreported:2"]
    # A report from a replaced incarnation is discarded too.
    new = table.join("w0", 200)
    assert not table.report("w0", inc["w0"], WorkerReport(generation=second, ready=True))
    assert table.report("w0", new, WorkerReport(generation=second, ready=True))


def test_a_worker_lost_while_closed_blocks_by_name_until_admission_reopens() -> None:
    table, _, inc = _table(3)
    gen = table.close()
    for w in ("w0", "w1", "w2"):
        table.report(w, inc[w], WorkerReport(generation=gen, ready=True))
    assert table.ready()
    assert table.lose("w1", inc["w1"])
    assert table.blockers() == ["worker-lost:w1"]
    assert not table.ready()
    # Its replacement starts closed and reports ready: the loss still blocks,
    # because the episodes the lost one held are gone from this checkpoint.
    new = table.join("w1", 300)
    assert table.report("w1", new, WorkerReport(generation=gen, ready=True))
    assert table.blockers() == ["worker-lost:w1"]
    assert not table.ready()
    assert not table.fresh()
    table.open()
    gen = table.close()
    for w in ("w0", "w1", "w2"):
        table.report(w, inc.get(w) if w != "w1" else new, WorkerReport(generation=gen, ready=True))
    assert table.ready()


def test_a_worker_lost_while_open_is_only_unreported_until_replaced() -> None:
    table, _, inc = _table()
    assert table.lose("w0", inc["w0"])
    assert not table.lose("w0", inc["w0"])  # once
    gen = table.close()
    table.report("w1", inc["w1"], WorkerReport(generation=gen, ready=True))
    assert table.blockers() == ["workers-unreported:1"]


def test_a_silent_worker_is_lost_and_a_heartbeat_keeps_it() -> None:
    table, clock, inc = _table()
    gen = table.close()
    clock.advance(4.0)
    table.heartbeat("w0", inc["w0"])
    clock.advance(4.0)
    table.report("w1", inc["w1"], WorkerReport(generation=gen, ready=True))
    assert table.expire() == []
    clock.advance(2.0)
    assert table.expire() == ["w0"]
    assert table.blockers() == ["worker-lost:w0"]


def test_fresh_and_live_sum_over_workers() -> None:
    table, _, inc = _table()
    gen = table.close()
    table.report("w0", inc["w0"], WorkerReport(generation=gen, ready=True, live=2, fresh=False))
    assert not table.fresh()  # w1 unreported
    table.report("w1", inc["w1"], WorkerReport(generation=gen, ready=True, live=3))
    assert table.live() == 5
    assert not table.fresh()  # w0 served
