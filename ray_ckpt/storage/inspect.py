"""`ray-ckpt inspect LOCATION`: validate a checkpoint (a directory or an
object-store URI such as `s3://bucket/run`) without Ray.

`inspect_checkpoint` verifies everything `verify_checkpoint` does and returns
a flat report (encode it with msgspec for ``--json``); `render_inspect` turns
it into a table for people.
"""

from __future__ import annotations

import io
import os

import msgspec
from rich.console import Console
from rich.table import Table

from ray_ckpt.storage.gym_manifest import verify_checkpoint


class InspectRow(msgspec.Struct, frozen=True):
    kind: str
    instance: str
    episodes: int
    bytes: int
    digest: str
    ok: bool
    listed: bool = True
    error: str | None = None


class InspectReport(msgspec.Struct, frozen=True):
    directory: str
    ok: bool
    checkpoint_id: str | None
    rows: list[InspectRow]
    errors: list[str]


def inspect_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> InspectReport:
    report = verify_checkpoint(checkpoint_dir)
    rows = [
        InspectRow(
            kind=c.kind,
            instance=c.instance,
            episodes=c.episodes,
            bytes=c.bytes,
            digest=c.digest,
            ok=c.ok,
            listed=c.listed,
            error=c.error,
        )
        for c in report.participants
    ]
    return InspectReport(
        directory=os.fspath(checkpoint_dir),
        ok=report.ok,
        checkpoint_id=report.checkpoint_id,
        rows=rows,
        errors=report.errors,
    )


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def render_inspect(report: InspectReport, *, width: int = 120) -> str:
    status = "OK" if report.ok else "INVALID"
    table = Table(title=f"checkpoint {report.checkpoint_id or '?'} in {report.directory}: {status}")
    for col in ("kind", "instance", "episodes", "size", "digest", "status"):
        table.add_column(col, justify="right" if col in ("episodes", "size") else "left")
    for r in report.rows:
        table.add_row(
            r.kind,
            r.instance,
            str(r.episodes),
            _size(r.bytes),
            r.digest[:16],
            "OK" if r.ok else f"FAILED: {r.error}",
        )
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False, color_system=None)
    console.print(table)
    for err in report.errors:
        console.print(f"error: {err}", markup=False, highlight=False)
    total = sum(r.episodes for r in report.rows)
    console.print(
        f"{len(report.rows)} participants, {total} episodes, "
        f"{_size(sum(r.bytes for r in report.rows))}",
        markup=False,
        highlight=False,
    )
    return out.getvalue()
