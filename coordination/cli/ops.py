"""`ray-ckpt resume` and `ray-ckpt forget`, and how every command attaches.

The coordinator a command creates is detached: it outlives the command, so
`ray-ckpt checkpoint DIR --keep-open` (publish your own files meanwhile) is
followed by `ray-ckpt resume` in another command, and an open checkpoint is
never left to lapse because the CLI process that opened it exited.  A
coordinator that already runs (a training loop's) is used as it is; `connect`
warns when it was created with other options.
"""

from __future__ import annotations

from typing import Any

import click

from coordination.cli.output import cluster_options, emit, fail
from ray_ckpt.errors import CheckpointError


def connect_cli(address: str, namespace: str) -> Any:
    from coordination.client.connect import connect

    return connect(
        namespace=namespace, address=None if address == "local" else address, detached=True
    )


@click.command()
@cluster_options
def resume(address: str, namespace: str, as_json: bool) -> None:
    """Resume the open checkpoint (after `checkpoint --keep-open`), callers last."""
    try:
        res = connect_cli(address, namespace).resume()
    except CheckpointError as exc:
        fail(exc, as_json)
    if as_json:
        emit(res)
        return
    if res.checkpoint_id is None:
        click.echo("no checkpoint was open: nothing to resume")
    else:
        click.echo(f"resumed {res.checkpoint_id} in {res.seconds:.3f}s")
    for who, why in sorted(res.failures.items()):
        click.echo(f"  not reached (its lease will lapse): {who}: {why.get('detail')}", err=True)


@click.command()
@click.argument("rollouts", nargs=-1, required=True)
@cluster_options
def forget(rollouts: tuple[str, ...], address: str, namespace: str, as_json: bool) -> None:
    """Forget ROLLOUTS everywhere (their retire marks and fences: the IDs may run again)."""
    try:
        res = connect_cli(address, namespace).forget(list(rollouts))
    except CheckpointError as exc:
        fail(exc, as_json)
    if as_json:
        emit(res)
        return
    for who, keys in sorted(res.forgotten.items()):
        click.echo(f"{who}: {', '.join(keys) or '-'}")


@click.command()
@click.argument("which", default="latest", metavar="[CHECKPOINT_ID|latest|DIR]")
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Path(dir_okay=False),
    help="File to write (the Chrome trace; needed for a checkpoint ID).",
)
@cluster_options
def timeline(which: str, output: str | None, address: str, namespace: str, as_json: bool) -> None:
    """A checkpoint's timeline: of DIR, read from its storage (saved beside its
    Gym manifest, with its restores; no Ray needed), or of a recent one by ID
    from the coordinator; -o writes it as a Chrome trace / Perfetto JSON."""
    import json
    import pathlib

    from coordination.cli.report import is_location, stored_timeline

    if is_location(which):
        stored_timeline(which, output, as_json)
        return
    if output is None:
        raise click.UsageError("give -o FILE for the Chrome trace of a checkpoint ID")
    try:
        trace = connect_cli(address, namespace).timeline(which)
    except CheckpointError as exc:
        fail(exc, as_json)
    pathlib.Path(output).write_text(json.dumps(trace))
    info = trace["otherData"]
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    rows = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    summary = {**info, "file": output, "rows": rows, "slices": len(slices)}
    if as_json:
        emit(summary)
        return
    click.echo(
        f"wrote {output}: {info['op']} {info['checkpoint_id']} ({info['trigger']}, "
        f"{info['outcome']}), {len(rows) - 1} participants, {len(slices)} slices; "
        "open it in chrome://tracing or ui.perfetto.dev"
    )
