"""A picture of each checkpoint: who did what when, kept and saved with it.

The coordinator's phase calls are spans (`ray_ckpt.tracing.recorded`): each
ends as a `SpanRecord` that is at once the OpenTelemetry span, the call's
timing the metrics observe and a slice here — one row per participant, the
coordinator's own steps (pausing the callers, publishing the Gym manifest)
on a `coordinator` row, and the slices a participant reports with its commit
reply (capture, write, release).  `chrome_trace` writes one in the Trace
Event Format that `chrome://tracing` and Perfetto open, the convention `ray
timeline` follows.

Times are the coordinator's clock (epoch seconds); a participant's own
slices are in its clock, so across nodes they are as close as the clocks are.
The last `KEEP` are kept in memory (`ray-ckpt timeline CHECKPOINT_ID`); each
complete checkpoint's is also saved beside its Gym manifest, and each
restore's beside the checkpoint it restored (`HistoryStore`,
`ray_ckpt.storage.root.history`), so it outlives the coordinator.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from ray_ckpt.errors import InvalidRequest
from ray_ckpt.storage.root.history import Timeline
from ray_ckpt.tracing import SpanRecord

log = logging.getLogger(__name__)

KEEP = 16
COORDINATOR_ROW = "coordinator"
Span = SpanRecord  # one slice of a timeline

__all__ = [
    "COORDINATOR_ROW",
    "KEEP",
    "HistoryStore",
    "Span",
    "StorageHistory",
    "Timeline",
    "TimelineRecorder",
    "chrome_trace",
    "row_order",
]


class HistoryStore(Protocol):
    """Where timelines are saved and read back (the coordinator's only touch
    with `ray_ckpt.storage.root.history`; unit tests pass a memory one)."""

    def save_checkpoint(self, checkpoint_dir: str, tl: Timeline) -> None: ...

    def save_restore(self, checkpoint_dir: str, tl: Timeline) -> None: ...

    def read_checkpoint(self, checkpoint_dir: str) -> Timeline | None: ...


class StorageHistory:
    """Timelines in the checkpoint's own location (a directory or a bucket)."""

    def save_checkpoint(self, checkpoint_dir: str, tl: Timeline) -> None:
        from ray_ckpt.storage.root.history import save_timeline

        save_timeline(checkpoint_dir, tl)

    def save_restore(self, checkpoint_dir: str, tl: Timeline) -> None:
        from ray_ckpt.storage.root.history import save_restore

        save_restore(checkpoint_dir, tl)

    def read_checkpoint(self, checkpoint_dir: str) -> Timeline | None:
        from ray_ckpt.storage.root.history import read_timeline

        return read_timeline(checkpoint_dir)


class TimelineRecorder:
    def __init__(self, keep: int = KEEP) -> None:
        self._keep = keep
        self._timelines: OrderedDict[str, Timeline] = OrderedDict()

    def _of(self, cid: str) -> Timeline:
        tl = self._timelines.get(cid)
        if tl is None:
            op = "restore" if cid.startswith("restore") else "checkpoint"
            tl = self._timelines[cid] = Timeline(checkpoint_id=cid, op=op)
            while len(self._timelines) > self._keep:
                self._timelines.popitem(last=False)
        return tl

    def add(self, cid: str, record: SpanRecord) -> None:
        """One finished span of operation `cid` (a `tracing.recorded` sink)."""
        tl = self._of(cid)
        tl.spans.append(record)
        if tl.started_at is None or record.start < tl.started_at:
            tl.started_at = record.start

    def sink(self, cid: str) -> Any:
        """The `tracing.SpanSink` that adds to `cid`."""
        return lambda record: self.add(cid, record)

    def span(
        self, cid: str, row: str, name: str, start: float, end: float, *, ok: bool = True
    ) -> None:
        self.add(cid, SpanRecord(row, name, start, max(end, start), ok))

    def note(self, cid: str, **fields: Any) -> None:
        """Set fields of `cid`'s timeline (trigger, bytes, the restart bias, ...)."""
        tl = self._of(cid)
        for name, value in fields.items():
            setattr(tl, name, value)

    def reported(self, cid: str, row: str, spans: object) -> None:
        """A participant's own slices from its reply; anything malformed is skipped
        (a timeline must never fail the checkpoint it pictures)."""
        if not isinstance(spans, list):
            return
        for s in spans:
            if not isinstance(s, Mapping):
                continue
            name, start, end = s.get("name"), s.get("start"), s.get("end")
            if (
                isinstance(name, str)
                and isinstance(start, (int, float))
                and isinstance(end, (int, float))
                and not isinstance(start, bool)
                and not isinstance(end, bool)
            ):
                self.span(cid, row, name, float(start), float(end))

    def finish(
        self, cid: str, *, outcome: str, trigger: str | None = None, at: float | None = None
    ) -> Timeline | None:
        tl = self._timelines.get(cid)
        if tl is not None:
            tl.outcome = outcome
            if trigger is not None:
                tl.trigger = trigger
            if at is not None:
                tl.finished_at = at
        return tl

    def peek(self, cid: str) -> Timeline | None:
        return self._timelines.get(cid)

    def newest(self, op: str) -> str | None:
        """The ID of the newest kept timeline of `op` (checkpoint or restore)."""
        for tl in reversed(self._timelines.values()):
            if tl.op == op:
                return tl.checkpoint_id
        return None

    def get(self, which: str = "latest") -> Timeline:
        """A kept timeline by checkpoint ID, or the newest checkpoint's ("latest")."""
        if which == "latest":
            newest = self.newest("checkpoint")
            if newest is None:
                raise InvalidRequest("no checkpoint has run since the coordinator started")
            return self._timelines[newest]
        found = self._timelines.get(which)
        if found is None:
            raise InvalidRequest(
                f"no timeline of {which!r}: the coordinator keeps the last {self._keep} "
                f"({', '.join(self._timelines) or 'none yet'}); a complete checkpoint's "
                "is saved with it: `ray-ckpt timeline DIR`"
            )
        return found


def row_order(spans: Iterable[Span]) -> list[str]:
    """The coordinator first, then participants in the order they were first called."""
    rows: list[str] = [COORDINATOR_ROW]
    for s in sorted(spans, key=lambda s: s.start):
        if s.row not in rows:
            rows.append(s.row)
    return rows


def chrome_trace(tl: Timeline) -> dict[str, Any]:
    """Trace Event Format: one process per checkpoint, one thread (row) per
    participant, a complete ("X") event per span, in microseconds."""
    rows = row_order(tl.spans)
    t0 = min((s.start for s in tl.spans), default=0.0)
    events: list[dict[str, Any]] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": 1,
            "args": {"name": f"{tl.op} {tl.checkpoint_id} ({tl.trigger}, {tl.outcome})"},
        }
    ]
    for tid, row in enumerate(rows):
        events.append(
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": row}}
        )
        events.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": 1,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    for s in sorted(tl.spans, key=lambda s: (s.start, s.end)):
        events.append(
            {
                "ph": "X",
                "name": s.name,
                "cat": tl.op,
                "pid": 1,
                "tid": rows.index(s.row),
                "ts": round((s.start - t0) * 1e6, 1),
                "dur": round((s.end - s.start) * 1e6, 1),
                "args": {"ok": s.ok},
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "checkpoint_id": tl.checkpoint_id,
            "op": tl.op,
            "trigger": tl.trigger,
            "outcome": tl.outcome,
            "start_epoch_s": t0,
            "durability": tl.durability,
            "checkpoint_dir": tl.checkpoint_dir,
            "total_bytes": tl.total_bytes,
            "source_checkpoint_id": tl.source_checkpoint_id,
            "restart_bias": None if tl.restart_bias is None else tl.restart_bias.as_table(),
        },
    }
