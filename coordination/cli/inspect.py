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

from coordination.cli.output import format_bytes
from ray_ckpt.errors import CheckpointError
from ray_ckpt.identity import is_result_key
from ray_ckpt.storage.blobstore.blobs import Blobs
from ray_ckpt.storage.blobstore.locations import open_location
from ray_ckpt.storage.participant.participant_manifest import load_manifest
from ray_ckpt.storage.root.gym_manifest import GYM_MANIFEST_KEY, verify_checkpoint


class InspectRow(msgspec.Struct, frozen=True):
    kind: str
    instance: str
    # The participant's records (one per episode it holds, plus held
    # results): per participant, so the rows do not add up to the episodes.
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
    # The checkpoint's episodes: distinct capture keys over every participant
    # (held results not counted), as `list`, `status` and the demo count
    # them; None when the manifests do not list them (NeMo Gym's).
    episodes: int | None = None
    bytes: int = 0  # the participants' records, as the Gym manifest lists them


def inspect_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> InspectReport:
    blobs = open_location(checkpoint_dir)
    report = verify_checkpoint(blobs)
    keys: set[str] | None = set()
    rows = []
    for c in report.participants:
        refs, listed = _references(blobs, c.kind, c.instance)
        if listed is None or keys is None:
            keys = None
        else:
            keys.update(k for k in listed if not is_result_key(k))
        rows.append(
            InspectRow(
                kind=c.kind,
                instance=c.instance,
                episodes=c.episodes,
                bytes=c.bytes,
                digest=c.digest,
                ok=c.ok,
                listed=c.listed,
                error=c.error,
                **refs,
            )
        )
    unpublished = not blobs.exists(GYM_MANIFEST_KEY) and bool(rows or blobs.list())
    return InspectReport(
        directory=os.fspath(checkpoint_dir),
        ok=report.ok,
        checkpoint_id=report.checkpoint_id,
        rows=rows,
        errors=report.errors,
        state="complete" if report.ok else "incomplete" if unpublished else "invalid",
        episodes=None if keys is None else len(keys),
        bytes=sum(r.bytes for r in rows),
    )


def _references(blobs: Blobs, kind: str, instance: str) -> tuple[dict[str, Any], list[str] | None]:
    """What an incremental manifest references, and the capture keys it
    lists (nothing for one unreadable: its row already says why)."""
    try:
        m = load_manifest(blobs, kind=kind, instance=instance, checkpoint_id=None)
    except CheckpointError:
        return {}, None
    refs = {"referenced": len(m.refs), "references": sorted({r.checkpoint for r in m.refs})}
    return refs, list(m.episodes)


def render_inspect(report: InspectReport, *, width: int = 120) -> str:
    status = {"complete": "OK", "incomplete": "INCOMPLETE (never published)"}.get(
        report.state, "INVALID"
    )
    table = Table(title=f"checkpoint {report.checkpoint_id or '?'} in {report.directory}: {status}")
    for col in ("kind", "instance", "records", "size", "digest", "references", "status"):
        table.add_column(col, justify="right" if col in ("records", "size") else "left")
    for r in report.rows:
        table.add_row(
            r.kind,
            r.instance,
            str(r.episodes),
            format_bytes(r.bytes),
            r.digest[:16],
            f"{r.referenced} in {', '.join(r.references)}" if r.referenced else "-",
            "OK" if r.ok else f"FAILED: {r.error}",
        )
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False, color_system=None)
    console.print(table)
    for err in report.errors:
        console.print(f"error: {err}", markup=False, highlight=False)
    episodes = "? episodes" if report.episodes is None else f"{report.episodes} episodes"
    console.print(
        f"{len(report.rows)} participants, {episodes}, {format_bytes(report.bytes)}",
        markup=False,
        highlight=False,
    )
    return out.getvalue()
