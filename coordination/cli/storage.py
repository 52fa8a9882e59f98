"""`ray-ckpt list` and `ray-ckpt gc`: the checkpoints under a root, no Ray needed.

Both read the root themselves (a directory or an object-store URI), through
the same catalog the coordinator's `latest` and retention use.
"""

from __future__ import annotations

import os
import pathlib

import click

from coordination.cli.output import (
    CliError,
    ExitCode,
    emit,
    fail,
    format_bytes,
    json_option,
    utc_time,
)
from ray_ckpt.errors import CheckpointError, NotFound
from ray_ckpt.storage.root.retention import DEFAULT_GRACE_S

# --- what a location holds: a checkpoint, a root of checkpoints, or neither ------------


def shape_of(location: str) -> str:
    """ "checkpoint" (a Gym manifest or participants' manifests at the top),
    "root" (a LATEST pointer or checkpoints one level down), "missing" (a
    local path that does not exist) or "other" (empty, or anything else).
    `InvalidRequest` for a location that cannot name one (relative, ...)."""
    from ray_ckpt.storage.blobstore.local_blobs import LocalBlobs
    from ray_ckpt.storage.blobstore.locations import open_location
    from ray_ckpt.storage.root.gym_manifest import GYM_MANIFEST_KEY
    from ray_ckpt.storage.root.pointer import LATEST_KEY

    blobs = open_location(location)
    if isinstance(blobs, LocalBlobs):
        path = _local_path(location)
        if not path.exists():
            return "missing"
        if not path.is_dir():
            return "other"
    if blobs.exists(GYM_MANIFEST_KEY):
        return "checkpoint"
    if blobs.exists(LATEST_KEY):
        return "root"
    keys = [i.key for i in blobs.list()]
    if any(k.count("/") == 2 and k.endswith("/gym/_manifest.json") for k in keys):
        return "root"
    # <kind>/<instance>/manifest.json at the top: an unpublished checkpoint.
    if any(k.count("/") == 2 and k.endswith("/manifest.json") for k in keys):
        return "checkpoint"
    return "other"


def _local_path(location: str) -> pathlib.Path:
    if location.startswith("file://"):
        from urllib.parse import urlsplit

        return pathlib.Path(urlsplit(location).path)
    return pathlib.Path(os.path.expanduser(location))


def expect_checkpoint(location: str, *, must_exist: bool = True) -> None:
    """Refuse a root (or a missing path) where one checkpoint is expected."""
    shape = shape_of(location)
    if shape == "missing" and must_exist:
        raise NotFound(f"{location} does not exist")
    if shape == "root":
        raise CliError(
            f"{location} is a root of checkpoints, not one checkpoint",
            ExitCode.BAD_INPUT,
            hint=f"`ray-ckpt list {location}` shows them; name one of its directories "
            "(or `restore ROOT --latest`)",
        )


def expect_root(location: str) -> None:
    """Refuse a checkpoint directory (or a missing path) where a root is expected."""
    shape = shape_of(location)
    if shape == "missing":
        raise NotFound(f"{location} does not exist")
    if shape == "checkpoint":
        raise CliError(
            f"{location} is one checkpoint, not a root of checkpoints",
            ExitCode.BAD_INPUT,
            hint=f"`ray-ckpt inspect {location}` checks it; `list` and `gc` take the "
            "directory that holds checkpoints",
        )


@click.command(name="list")
@click.argument("root")
@json_option
def list_command(root: str, as_json: bool) -> None:
    """The checkpoints under ROOT, oldest first, and which are complete."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from coordination.engine.roots import list_root

    try:
        expect_root(root)
        entries = list_root(root)
    except CheckpointError as exc:
        fail(exc, as_json)
    if as_json:
        emit(entries)
        return
    # Names come from the store: never read as rich markup.
    table = Table(title=escape(f"{root}: {len(entries)} checkpoints"))
    table.add_column("name", no_wrap=True)
    for col in ("checkpoint ID", "time (UTC)", "participants", "episodes", "bytes"):
        table.add_column(col, justify="right" if col in ("participants", "episodes") else "left")
    table.add_column("complete")
    table.add_column("referenced by")
    for e in entries:
        table.add_row(
            escape(e.name),
            escape(e.checkpoint_id or "-"),
            utc_time(e.time),
            str(e.participants),
            str(e.episodes),
            format_bytes(e.bytes),
            "yes" if e.complete else "[red]no[/red]",
            escape(", ".join(e.referenced_by) or "-"),
        )
    Console().print(table)


@click.command(name="gc")
@click.argument("root")
@click.option("--keep", type=int, required=True, help="Complete checkpoints to keep (>= 1).")
@click.option("--dry-run", is_flag=True, help="Print the plan; delete nothing.")
@click.option(
    "--grace-s",
    type=float,
    default=DEFAULT_GRACE_S,
    show_default=True,
    help="Temp objects and incomplete checkpoints younger than this are in flight: kept.",
)
@json_option
def gc_command(root: str, keep: int, dry_run: bool, grace_s: float, as_json: bool) -> None:
    """Keep the KEEP newest complete checkpoints under ROOT; delete the rest.

    An old one goes only once KEEP newer ones are complete; a file a kept
    checkpoint needs, the one LATEST names, the trainer's own files and
    anything written to within the grace period always stay."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from coordination.engine.roots import gc_root

    try:
        expect_root(root)
        plan = gc_root(root, keep, dry_run=dry_run, grace_s=grace_s)
    except CheckpointError as exc:
        fail(exc, as_json)
    if as_json:
        emit(plan)
        return
    verb = "would delete" if plan.dry_run else "deleted"
    title = (
        f"{root}: {verb} {len(plan.delete)} objects ({format_bytes(plan.bytes)}), keep {plan.keep}"
    )
    table = Table(title=escape(title) + (" (dry run)" if plan.dry_run else ""))
    table.add_column("checkpoint", no_wrap=True)
    for col in ("action", "reason", "objects", "bytes"):
        table.add_column(col)
    for r in plan.rows:
        action = r.action if r.action == "keep" else f"[red]{r.action}[/red]"
        table.add_row(escape(r.name), action, escape(r.reason), str(r.keys), format_bytes(r.bytes))
    Console().print(table)
