"""`ray-ckpt inspect LOCATION`: validate a checkpoint (a directory or an
object-store URI such as `s3://bucket/run`) without Ray.

`inspect_checkpoint` verifies everything `verify_checkpoint` does (for an
incremental checkpoint, every frame it references in earlier checkpoints'
files too) and returns a flat report (encode it with msgspec for ``--json``); `render_inspect` turns
it into a table for people.
"""

from __future__ import annotations

import io
import os
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from ray_ckpt.errors import CheckpointError
from ray_ckpt.storage.blobstore.blobs import Blobs
from ray_ckpt.storage.blobstore.locations import open_location
from ray_ckpt.storage.participant.participant_manifest import load_manifest
from ray_ckpt.storage.root.gym_manifest import GYM_MANIFEST_KEY, verify_checkpoint


class InspectRow(msgspec.Struct, frozen=True):
    kind: str
    instance: str
    episodes: int
    bytes: int
    digest: str
    ok: bool
    listed: bool = True
    error: str | None = None
    # Incremental: records held in earlier checkpoints' files, and their names.
    referenced: int = 0
    references: list[str] = []


class InspectReport(msgspec.Struct, frozen=True):
    directory: str
    ok: bool
    checkpoint_id: str | None
    rows: list[InspectRow]
    errors: list[str]
    # "complete"; "incomplete": participants' records but no Gym manifest, a
    # checkpoint never published (a crash before it was durable, an
    # asynchronous write that failed); "invalid": anything else wrong.
    state: str = "complete"


def inspect_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> InspectReport:
    blobs = open_location(checkpoint_dir)
    report = verify_checkpoint(blobs)
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
            **_references(blobs, c.kind, c.instance),
        )
        for c in report.participants
    ]
    unpublished = not blobs.exists(GYM_MANIFEST_KEY) and bool(rows or blobs.list())
    return InspectReport(
        directory=os.fspath(checkpoint_dir),
        ok=report.ok,
        checkpoint_id=report.checkpoint_id,
        rows=rows,
        errors=report.errors,
        state="complete" if report.ok else "incomplete" if unpublished else "invalid",
    )


def _references(blobs: Blobs, kind: str, instance: str) -> dict[str, Any]:
    """What an incremental manifest references (nothing for one unreadable:
    its row already says why)."""
    try:
        m = load_manifest(blobs, kind=kind, instance=instance, checkpoint_id=None)
    except CheckpointError:
        return {}
    return {"referenced": len(m.refs), "references": sorted({r.checkpoint for r in m.refs})}


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def render_inspect(report: InspectReport, *, width: int = 120) -> str:
    status = {"complete": "OK", "incomplete": "INCOMPLETE (never published)"}.get(
        report.state, "INVALID"
    )
    table = Table(title=f"checkpoint {report.checkpoint_id or '?'} in {report.directory}: {status}")
    for col in ("kind", "instance", "episodes", "size", "digest", "references", "status"):
        table.add_column(col, justify="right" if col in ("episodes", "size") else "left")
    for r in report.rows:
        table.add_row(
            r.kind,
            r.instance,
            str(r.episodes),
            _size(r.bytes),
            r.digest[:16],
            f"{r.referenced} in {', '.join(r.references)}" if r.referenced else "-",
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
