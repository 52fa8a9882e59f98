"""`ray-ckpt report ROOT -o report.html` and `ray-ckpt timeline DIR`: a
checkpoint root's history, read from storage alone.

Both read what each checkpoint saved beside its Gym manifest
(`ray_ckpt.storage.root.history`): no coordinator, no Ray, any machine that
can read the location.  The report is one self-contained HTML page — inline
CSS and SVG, no script, no font, no image, nothing fetched — so it opens
from a file, an artifact store or a mail attachment alike: every checkpoint
with its time, trigger, durability, bytes and incremental chain, each
participant's phases drawn as bars on a common time axis, and each restore
with its restart bias.
"""

from __future__ import annotations

import html
import json
import pathlib
from collections.abc import Iterable
from typing import Any

import click
import msgspec

from coordination.cli.output import emit, fail, json_option, size, utc_time
from coordination.engine.timeline import COORDINATOR_ROW, chrome_trace, row_order
from ray_ckpt.errors import CheckpointError, InvalidCheckpointState
from ray_ckpt.storage.root.history import (
    BUCKETS,
    OUTCOMES,
    CheckpointHistory,
    HistoryRow,
    RestartBias,
    RootHistory,
    Timeline,
    read_history,
    read_root_history,
)

# A phase's colour in the bars (anything else: grey).
COLOURS = {
    "prepare": "#4e79a7",
    "commit": "#f28e2b",
    "capture": "#edc948",
    "write": "#e15759",
    "release": "#b07aa1",
    "durable": "#ff9da7",
    "resume": "#59a14f",
    "restore": "#76b7b2",
    "retire": "#9c755f",
    "publish": "#000000",
    "pause callers": "#bab0ac",
    "resume callers": "#bab0ac",
}


def _size(n: int | None) -> str:
    return "-" if n is None else size(n)


def is_location(text: str) -> bool:
    """A checkpoint location (absolute path or URI), not a checkpoint ID."""
    return text.startswith("/") or "://" in text


# --- ray-ckpt timeline DIR ----------------------------------------------------------


def phase_table(tl: Timeline) -> dict[str, dict[str, float]]:
    """Seconds per participant (row) and phase, summed over its slices."""
    table: dict[str, dict[str, float]] = {}
    for s in tl.spans:
        row = table.setdefault(s.row, {})
        row[s.name] = row.get(s.name, 0.0) + s.seconds
    return {r: table[r] for r in row_order(tl.spans) if r in table}


def bias_lines(bias: RestartBias | None) -> list[str]:
    """The restart bias as text lines (the CLI's restore and timeline output)."""
    if bias is None:
        return []
    t = bias.totals()
    lines = [
        f"restart bias: {t['continued']} continued, {t['restarted']} restarted, "
        f"{t['lost']} lost"
        + ("" if bias.known else " (the checkpoint saved no progress: buckets unknown)")
    ]
    lines.append("  steps done   continued  restarted  lost")
    for r in bias.rows:
        if r.continued or r.restarted or r.lost:
            lines.append(f"  {r.bucket:<11}  {r.continued:>9}  {r.restarted:>9}  {r.lost:>4}")
    return lines


def stored_timeline(location: str, output: str | None, as_json: bool) -> None:
    """`ray-ckpt timeline DIR`: the checkpoint's saved timeline and its restores."""
    try:
        found = read_history(location)
        if found.timeline is None and not found.restores:
            raise InvalidCheckpointState(
                f"no saved timeline in {found.location}: a checkpoint keeps one beside its "
                "Gym manifest (gym/_timeline.json) once it is complete; give a checkpoint "
                "directory, not its root (`ray-ckpt report ROOT` covers a root)"
                + ("; " + "; ".join(found.problems) if found.problems else "")
            )
    except CheckpointError as exc:
        fail(exc, as_json)
    if output is not None:
        trace = merged_trace(found)
        pathlib.Path(output).write_text(json.dumps(trace))
    if as_json:
        emit({**msgspec.to_builtins(found), "file": output})
        return
    for line in timeline_lines(found):
        click.echo(line)
    if output is not None:
        click.echo(f"wrote {output}: open it in chrome://tracing or ui.perfetto.dev")


def timeline_lines(found: CheckpointHistory) -> list[str]:
    lines = []
    tl = found.timeline
    if tl is not None:
        lines.append(
            f"{tl.op} {tl.checkpoint_id} ({tl.trigger}, {tl.durability}, {tl.outcome}) "
            f"at {utc_time(tl.started_at or 0.0)} UTC, {_size(tl.total_bytes)}"
        )
        for row, phases in phase_table(tl).items():
            cells = ", ".join(f"{name} {s * 1000:.1f} ms" for name, s in phases.items())
            lines.append(f"  {row}: {cells}")
    else:
        lines.append(f"{found.location}: no saved timeline of the checkpoint itself")
    for r in found.restores:
        lines.append(
            f"restore {r.checkpoint_id} ({r.outcome}) at {utc_time(r.started_at or 0.0)} UTC"
        )
        lines.extend("  " + line for line in bias_lines(r.restart_bias))
    lines.extend(f"unreadable: {p}" for p in found.problems)
    return lines


def merged_trace(found: CheckpointHistory) -> dict[str, Any]:
    """The checkpoint and each restore as processes of one Chrome trace, on
    one time axis."""
    tls = [t for t in (found.timeline, *found.restores) if t is not None]
    t0 = min((s.start for t in tls for s in t.spans), default=0.0)
    events: list[dict[str, Any]] = []
    for pid, tl in enumerate(tls, start=1):
        one = chrome_trace(tl)
        shift = (min((s.start for s in tl.spans), default=t0) - t0) * 1e6
        for e in one["traceEvents"]:
            e = {**e, "pid": pid}
            if e["ph"] == "X":
                e["ts"] = round(e["ts"] + shift, 1)
            events.append(e)
    info = chrome_trace(tls[0])["otherData"] if tls else {}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": info}


# --- ray-ckpt report ROOT ----------------------------------------------------------


@click.command("report")
@click.argument("root")
@click.option(
    "-o",
    "--output",
    "output",
    required=True,
    type=click.Path(dir_okay=False),
    help="The HTML file to write (self-contained: open it anywhere).",
)
@json_option
def report_command(root: str, output: str, as_json: bool) -> None:
    """Write ROOT's checkpoint history as one self-contained HTML page:
    time, trigger, durability, bytes, incremental chain, each participant's
    phases as bars, the restores and their restart bias."""
    try:
        history = read_root_history(root)
        if not history.rows:
            raise InvalidCheckpointState(
                f"no checkpoint under {history.location}: give the root that holds "
                "the checkpoint directories"
            )
    except CheckpointError as exc:
        fail(exc, as_json)
    pathlib.Path(output).write_text(render(history), encoding="utf-8")
    saved = sum(r.history.timeline is not None for r in history.rows)
    restores = sum(len(r.history.restores) for r in history.rows)
    if as_json:
        emit(
            {
                "file": output,
                "location": history.location,
                "checkpoints": len(history.rows),
                "timelines": saved,
                "restores": restores,
            }
        )
        return
    click.echo(
        f"wrote {output}: {len(history.rows)} checkpoints ({saved} with a timeline), "
        f"{restores} restores"
    )


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;margin:8px 0}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}
.bad{color:#b00}.muted{color:#777}
svg text{font:11px system-ui,sans-serif}
.legend span{display:inline-block;margin-right:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
"""


def render(history: RootHistory) -> str:
    """The whole page (no script, nothing external)."""
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>ray-ckpt report: {_e(history.location)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>Checkpoint history of {_e(history.location)}</h1>",
        _summary_table(history.rows),
        _legend(),
    ]
    for row in reversed(history.rows):  # newest first, as one looks for it
        parts.append(_checkpoint_section(row))
    parts.append("</body></html>")
    return "\n".join(parts)


def _legend() -> str:
    items = "".join(
        f'<span><i style="background:{c}"></i>{_e(n)}</span>' for n, c in COLOURS.items()
    )
    return f'<p class="legend">{items}</p>'


def _summary_table(rows: Iterable[HistoryRow]) -> str:
    head = (
        "<tr><th>checkpoint</th><th>time (UTC)</th><th>trigger</th><th>durability</th>"
        "<th>state</th><th>bytes</th><th>episodes</th><th>builds on</th>"
        "<th>needed by</th><th>restores</th></tr>"
    )
    body = []
    for r in rows:
        tl = r.history.timeline
        state = "complete" if r.complete else '<span class="bad">incomplete</span>'
        if r.latest:
            state += " (LATEST)"
        body.append(
            f'<tr class="checkpoint" data-name="{_e(r.name)}">'
            f'<td><a href="#ck-{_e(r.name)}">{_e(r.name)}</a></td>'
            f"<td>{_e(utc_time(r.time))}</td>"
            f"<td>{_e(tl.trigger if tl else '-')}</td>"
            f"<td>{_e(tl.durability if tl else '-')}</td>"
            f"<td>{state}</td>"
            f'<td class="n">{_e(size(r.bytes))}</td>'
            f'<td class="n">{r.episodes}</td>'
            f"<td>{_e(', '.join(r.builds_on) or '-')}</td>"
            f"<td>{_e(', '.join(r.referenced_by) or '-')}</td>"
            f'<td class="n">{len(r.history.restores)}</td></tr>'
        )
    return f'<table id="checkpoints">{head}{"".join(body)}</table>'


def _checkpoint_section(r: HistoryRow) -> str:
    out = [f'<section class="history" id="ck-{_e(r.name)}">']
    out.append(f"<h2>{_e(r.name)} <span class='muted'>{_e(r.checkpoint_id or '')}</span></h2>")
    tl = r.history.timeline
    if tl is None:
        out.append('<p class="muted">No saved timeline (an older or unfinished checkpoint).</p>')
    else:
        out.append(
            f"<p>{_e(tl.trigger)}, {_e(tl.durability)}, {_e(tl.outcome)}; "
            f"records {_e(_size(tl.total_bytes))}; of its scope {len(tl.continued)} "
            f"episodes continue, {len(tl.restart)} start over</p>"
        )
        out.append(_bars(tl))
        out.append(_phase_durations(tl))
    for restore in r.history.restores:
        out.append(_restore_block(restore))
    for problem in r.history.problems:
        out.append(f'<p class="bad">unreadable: {_e(problem)}</p>')
    out.append("</section>")
    return "\n".join(out)


def _bars(tl: Timeline, width: int = 760) -> str:
    """Each row's spans as bars on one time axis (inline SVG)."""
    rows = [r for r in row_order(tl.spans) if any(s.row == r for s in tl.spans)]
    if not tl.spans:
        return ""
    t0 = min(s.start for s in tl.spans)
    t1 = max(s.end for s in tl.spans)
    span = max(t1 - t0, 1e-6)
    label, lane = 170, 18
    scale = (width - label - 10) / span
    height = lane * len(rows) + 24
    out = [
        f'<svg class="bars" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img">'
    ]
    for i, row in enumerate(rows):
        y = i * lane
        out.append(f'<text x="0" y="{y + 13}">{_e(row)}</text>')
        for s in (s for s in tl.spans if s.row == row):
            x = label + (s.start - t0) * scale
            w = max((s.end - s.start) * scale, 1.0)
            colour = COLOURS.get(s.name, "#999999")
            stroke = "" if s.ok else ' stroke="#b00" stroke-width="2"'
            out.append(
                f'<rect class="span" data-row="{_e(row)}" data-name="{_e(s.name)}" '
                f'x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{lane - 6}" '
                f'fill="{colour}"{stroke}><title>{_e(row)}: {_e(s.name)} '
                f"{(s.end - s.start) * 1000:.1f} ms</title></rect>"
            )
    axis_y = lane * len(rows) + 16
    out.append(f'<text x="{label}" y="{axis_y}">0 ms</text>')
    out.append(f'<text x="{width - 10}" y="{axis_y}" text-anchor="end">{span * 1000:.1f} ms</text>')
    out.append("</svg>")
    return "".join(out)


def _phase_durations(tl: Timeline) -> str:
    table = phase_table(tl)
    names = list(dict.fromkeys(n for phases in table.values() for n in phases))
    head = "".join(f"<th>{_e(n)} (ms)</th>" for n in names)
    body = []
    for row, phases in table.items():
        cells = "".join(
            f'<td class="n">{phases[n] * 1000:.1f}</td>' if n in phases else "<td></td>"
            for n in names
        )
        kind = "coordinator" if row == COORDINATOR_ROW else "participant"
        body.append(f'<tr class="phases {kind}"><td>{_e(row)}</td>{cells}</tr>')
    return f'<table class="phases"><tr><th>row</th>{head}</tr>{"".join(body)}</table>'


def _restore_block(r: Timeline) -> str:
    out = [
        f'<div class="restore" data-id="{_e(r.checkpoint_id)}">'
        f"<h3>restore {_e(r.checkpoint_id)} <span class='muted'>{_e(r.outcome)}, "
        f"{_e(utc_time(r.started_at or 0.0))} UTC</span></h3>"
    ]
    bias = r.restart_bias
    if bias is not None:
        t = bias.totals()
        note = "" if bias.known else " (the checkpoint saved no progress: buckets unknown)"
        out.append(
            f"<p>{t['continued']} continued, {t['restarted']} restarted, "
            f"{t['lost']} lost{_e(note)}</p>"
        )
        head = "".join(f"<th>{o}</th>" for o in OUTCOMES)
        rows = "".join(
            f'<tr class="bias" data-bucket="{_e(b.bucket)}"><td>{_e(b.bucket)}</td>'
            + "".join(f'<td class="n">{getattr(b, o)}</td>' for o in OUTCOMES)
            + "</tr>"
            for b in bias.rows
            if b.bucket in BUCKETS
        )
        out.append(f'<table class="bias"><tr><th>steps done</th>{head}</tr>{rows}</table>')
    out.append(_bars(r))
    out.append("</div>")
    return "\n".join(out)
