"""A picture of each recent checkpoint: who did what when, as a Chrome trace.

The coordinator notes a span for every call of every phase (one row per
participant), its own steps (pausing the callers, publishing the Gym
manifest) on a `coordinator` row, and the slices a participant reports with
its commit reply (capture, write, release).  `chrome_trace` writes one
checkpoint in the Trace Event Format that `chrome://tracing` and Perfetto
open, the convention `ray timeline` follows.

Times are the coordinator's clock (epoch seconds); a participant's own
slices are in its clock, so across nodes they are as close as the clocks are.
Only the last `KEEP` operations are kept, in memory: the coordinator is the
one process that sees every phase, and a timeline is for looking at, not a
record that must survive it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from ray_ckpt.errors import InvalidRequest

KEEP = 16
COORDINATOR_ROW = "coordinator"


class Span(msgspec.Struct, frozen=True):
    row: str  # "coordinator" or a participant key `<kind>/<name>`
    name: str  # prepare, commit, capture, write, publish, ...
    start: float
    end: float
    ok: bool = True


class Timeline(msgspec.Struct, kw_only=True):
    checkpoint_id: str
    op: str  # checkpoint | restore
    trigger: str = "manual"
    outcome: str = "open"  # open | ok | failed | aborted (called off before a commit)
    spans: list[Span] = msgspec.field(default_factory=list)


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

    def span(
        self, cid: str, row: str, name: str, start: float, end: float, *, ok: bool = True
    ) -> None:
        self._of(cid).spans.append(Span(row, name, start, max(end, start), ok))

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

    def finish(self, cid: str, *, outcome: str, trigger: str | None = None) -> None:
        tl = self._timelines.get(cid)
        if tl is not None:
            tl.outcome = outcome
            if trigger is not None:
                tl.trigger = trigger

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
                f"({', '.join(self._timelines) or 'none yet'})"
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
        },
    }
