"""`ray-ckpt`: status, checkpoint, resume, restore, retire, forget, collect, ack,
inspect, list, gc, timeline (and `--version`); `ray-ckpt demo` is the main
job's, added on top (`coordination.demo.app`: no library module imports the demo).

Every command that talks to the cluster attaches with `--address` (default
"auto") and `--namespace`, and gets or creates the namespace's coordinator
(detached: it outlives the command, `coordination/cli/ops.py`);
`--json` prints one JSON object on stdout instead of a table.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import click
import msgspec

from coordination.cli.grafana import grafana_dashboard
from coordination.cli.ops import connect_cli, forget, resume, timeline
from coordination.cli.output import (
    CliError,
    ExitCode,
    RayCkptGroup,
    cluster_options,
    emit,
    fail,
    format_bytes,
    json_option,
    last_checkpoint_line,
    lease_left,
    periodic_line,
)
from coordination.cli.receipts import ack, collect
from coordination.cli.report import bias_lines, report_command
from coordination.cli.schema import schema
from coordination.cli.storage import expect_checkpoint, expect_root, gc_command, list_command
from coordination.engine.results import ParticipantStatus
from ray_ckpt.errors import CheckpointError, InvalidRequest


def _connect(address: str, namespace: str) -> Any:
    return connect_cli(address, namespace)


def _location(directory: str) -> None:
    """Refuse a relative path or an unknown scheme here, before attaching to
    Ray; whether the location can be reached is checked by the coordinator,
    where the checkpoint runs, before it pauses anyone.  A local root of
    checkpoints is refused too (a store is not listed: that costs a round trip
    the coordinator's own check makes anyway)."""
    from ray_ckpt.storage.blobstore.locations import open_location

    open_location(directory)
    if _is_local(directory):
        expect_checkpoint(directory, must_exist=False)


def _is_local(directory: str) -> bool:
    return "://" not in directory or directory.startswith("file://")


def _remember_debug(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    ctx.meta["ray_ckpt.debug"] = value
    return value


@click.group(cls=RayCkptGroup)
@click.version_option(package_name="ray-ckpt", prog_name="ray-ckpt")
@click.option(
    "--debug",
    is_flag=True,
    expose_value=False,
    callback=_remember_debug,
    help="On an error, print the traceback (and Python warnings) too.",
)
def main() -> None:
    """Checkpoint and restore Gym servers on Ray.

    Every error is one line on stderr; exit codes: 0 ok, 1 failed (e.g. an
    invalid checkpoint), 2 bad input, 3 not found, 4 conflict, 5 unavailable
    (docs/operations/cli.md)."""


main.add_command(list_command)
main.add_command(gc_command)
main.add_command(resume)
main.add_command(forget)
main.add_command(timeline)
main.add_command(report_command)
main.add_command(collect)
main.add_command(ack)
main.add_command(schema)
main.add_command(grafana_dashboard)


@main.command()
@cluster_options
def status(address: str, namespace: str, as_json: bool) -> None:
    """Participants (kind, phase, checkpoint, lease, live episodes, writes in flight,
    blockers) and the coordinator's last checkpoint.  Creates nothing: with no
    coordinator in the namespace it says so (exit 3)."""
    from rich.console import Console
    from rich.table import Table

    try:
        # Only find the coordinator: looking must not create one.
        st = connect_cli(address, namespace, create=False).status()
    except CheckpointError as exc:
        fail(exc, as_json)
    if as_json:
        emit(st)
        return
    title = f"namespace {namespace}: " + (
        f"checkpoint {st.open_checkpoint} {st.phase}"
        if st.open_checkpoint
        else "no checkpoint open"
    )
    table = Table(title=title)
    table.add_column("participant", no_wrap=True)
    for col in ("kind", "phase", "checkpoint", "lease left", "live", "in flight", "writes"):
        table.add_column(col)
    table.add_column("blockers")
    now = st.now if st.now is not None else time.time()
    for p in st.participants:
        blockers = ", ".join(_blocker_cell(p)[:5]) + (" …" if p.blocker_count > 5 else "")
        table.add_row(
            p.participant,
            p.kind,
            p.phase or f"[red]{p.error or '?'}[/red]",
            p.checkpoint_id or "-",
            lease_left(p.lease_expires_at, now),
            "-" if p.live_executions is None else str(p.live_executions),
            _keys_cell(p.live_keys),
            "-" if p.writes_in_flight is None else str(p.writes_in_flight),
            blockers or "-",
        )
    Console().print(table)
    click.echo(last_checkpoint_line(st.last_checkpoint, now))
    if st.periodic is not None:
        click.echo(periodic_line(st.periodic))


def _keys_cell(keys: list[str] | None, shown: int = 6) -> str:
    """The capture keys in flight ("?": a participant that does not say)."""
    if keys is None:
        return "?"
    more = f" +{len(keys) - shown}" if len(keys) > shown else ""
    return (", ".join(keys[:shown]) + more) or "-"


def _blocker_cell(p: ParticipantStatus) -> list[str]:
    """Each blocker's key, with its state and step when the participant says them
    (`blocker_details`); a participant that sends keys only shows keys."""
    cells: list[str] = []
    for d in p.blocker_details or [{"key": k} for k in p.blockers]:
        extra = " ".join(str(d[f]) for f in ("state", "step") if d.get(f) is not None)
        cells.append(f"{d.get('key')} ({extra})" if extra else str(d.get("key")))
    return cells


@main.command()
@click.argument("directory")
@click.option("--scope", "scope", multiple=True, help="Capture key to continue (repeatable).")
@click.option(
    "--keep-open",
    is_flag=True,
    help="Leave it open (no resume): publish your own checkpoint, then run `resume`.",
)
@click.option(
    "--strict",
    is_flag=True,
    help="Refuse (nothing published) if an episode of the scope has no state anywhere.",
)
@click.option(
    "--async",
    "asynchronous",
    is_flag=True,
    help="Resume once captured; write in the background (prints when resumed and when durable).",
)
@cluster_options
def checkpoint(
    directory: str,
    scope: tuple[str, ...],
    keep_open: bool,
    strict: bool,
    asynchronous: bool,
    address: str,
    namespace: str,
    as_json: bool,
) -> None:
    """Checkpoint every participant into DIRECTORY."""
    if asynchronous and keep_open:
        raise click.UsageError("--async resumes the Gym at once: not with --keep-open")
    try:
        _location(directory)
        gym = _connect(address, namespace)
        if not scope:
            _scope_or_refuse(gym)
        if asynchronous:
            _checkpoint_async(gym, directory, list(scope) or None, strict, as_json)
            return
        res = gym.checkpoint(
            directory, scope=list(scope) or None, resume=not keep_open, strict=strict
        )
    except CheckpointError as exc:
        fail(exc, as_json)
    if as_json:
        emit(res)
        return
    click.echo(
        f"checkpoint {res.checkpoint_id} → {res.checkpoint_dir}: {len(res.timings)} participants, "
        f"{format_bytes(res.total_bytes)}, {res.total_s:.3f}s (prepare {res.prepare_s:.3f}s, "
        f"commit {res.commit_s:.3f}s); {len(res.continued)} episodes continue, "
        f"{len(res.restart)} start over" + (f" ({', '.join(res.restart)})" if res.restart else "")
    )


def _scope_or_refuse(gym: Any) -> None:
    """No --scope: fine when the assembler's scope method names it, or when
    every participant exports all it holds; else refused here, before anyone
    is paused, listing the capture keys in flight to pass as --scope."""
    st = gym.status()
    needing = [p.participant for p in st.participants if p.needs_scope]
    if st.scope_source or not needing:
        return
    keys = sorted({k for p in st.participants for k in p.live_keys or []})
    listed = " ".join(f"--scope {k}" for k in keys[:20]) + (" …" if len(keys) > 20 else "")
    raise CliError(
        f"{', '.join(needing)} checkpoint only a named scope, and no assembler's scope "
        "method is registered to name it",
        ExitCode.BAD_INPUT,
        hint=f"name the episodes to continue: {listed}"
        if keys
        else "nothing is in flight now; name the episodes to continue with --scope KEY",
    )


def _checkpoint_async(
    gym: Any, directory: str, scope: list[str] | None, strict: bool, as_json: bool
) -> None:
    """Say when the Gym is resumed, then when the checkpoint is durable."""
    started = time.monotonic()
    pending = gym.checkpoint(directory, scope=scope, strict=strict, durability="async")
    resumed_s = time.monotonic() - started
    res = pending.result
    if not as_json:
        click.echo(
            f"resumed after {resumed_s:.3f}s: {res.checkpoint_id} captured "
            f"{sum(map(len, res.episode_ids.values()))} episodes from {len(res.timings)} "
            "participants; writing…"
        )
    done = pending.durable()
    durable_s = time.monotonic() - started
    if as_json:
        emit({"checkpoint": res, "durable": done, "resumed_s": resumed_s, "durable_s": durable_s})
        return
    click.echo(
        f"durable after {durable_s:.3f}s: {done.checkpoint_id} → {done.checkpoint_dir}, "
        f"{format_bytes(done.total_bytes)} (the capture held {format_bytes(done.captured_bytes)})"
    )


@main.command()
@click.argument("directory")
@click.option("--episode", "episodes", multiple=True, help="Capture key to restore (repeatable).")
@click.option(
    "--latest",
    is_flag=True,
    help="DIRECTORY is a root: restore its newest complete checkpoint (the one LATEST "
    "names if complete, else the newest by time).",
)
@click.option(
    "--without-gym-manifest",
    "without_gym_manifest",
    is_flag=True,
    help="Accept a DIRECTORY with no gym/_manifest.json (as NeMo Gym's controller writes): "
    "restore from the participant manifests once each is there, complete, of one checkpoint.",
)
@click.option(
    "--relaunch",
    is_flag=True,
    help="First replace every registered host with a fresh one (same spec, node and port; "
    "detached): a restore installs only into fresh processes.",
)
@cluster_options
def restore(
    directory: str,
    episodes: tuple[str, ...],
    latest: bool,
    without_gym_manifest: bool,
    relaunch: bool,
    address: str,
    namespace: str,
    as_json: bool,
) -> None:
    """Restore a fresh fleet from DIRECTORY, all or nothing."""
    relaunched: dict[str, str] = {}
    try:
        _location_to_restore(directory, latest)
        if relaunch:
            relaunched = _relaunch(address, namespace, directory, latest, without_gym_manifest)
        keys = list(episodes)
        if latest:
            # The coordinator picks the checkpoint and, without --episode, its episodes.
            res = _connect(address, namespace).restore(
                directory,
                keys or None,
                allow_without_gym_manifest=without_gym_manifest,
                latest=True,
            )
        else:
            if not keys:
                keys = _checkpointed_episodes(directory, without_gym_manifest)
            res = _connect(address, namespace).restore(
                directory, keys, allow_without_gym_manifest=without_gym_manifest
            )
    except CheckpointError as exc:
        fail(exc, as_json)
    if as_json:
        # With --relaunch: the result's keys plus `relaunched` (member → URL).
        emit({**msgspec.to_builtins(res), "relaunched": relaunched} if relaunch else res)
        return
    for who, url in sorted(relaunched.items()):
        click.echo(f"relaunched {who} at {url}")
    total = sum(len(v) for v in res.restored.values())
    click.echo(
        f"restored {total} episode attempts from {res.source_checkpoint_id} "
        f"({res.checkpoint_dir}) in {res.total_s:.3f}s;"
        f" {len(res.continued)} episodes continue, {len(res.restart)} start over"
    )
    for line in bias_lines(res.restart_bias):
        click.echo(line)
    for who, why in sorted(res.resume_failures.items()):
        click.echo(f"  not resumed (its lease will lapse): {who}: {why.get('detail')}", err=True)


def _relaunch(
    address: str, namespace: str, directory: str, latest: bool, without_gym_manifest: bool
) -> dict[str, str]:
    """The fresh Gym a restore needs, after what can be checked without it:
    the checkpoint's episodes are read first, so a bad directory stops
    nothing."""
    import asyncio
    import concurrent.futures

    from coordination.cli.ops import relaunch_registered

    if not latest:
        _checkpointed_episodes(directory, without_gym_manifest)
    gym = _connect(address, namespace)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(relaunch_registered(gym, namespace))
    # Called from inside an event loop (a program driving the CLI in process).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, relaunch_registered(gym, namespace)).result()


def _location_to_restore(directory: str, latest: bool) -> None:
    """A missing path, or a root without --latest (a checkpoint with it), is
    refused before attaching to Ray."""
    from ray_ckpt.storage.blobstore.locations import open_location

    open_location(directory)
    if not _is_local(directory):
        return  # the coordinator reads the store (and says what is wrong)
    if latest:
        expect_root(directory)
    else:
        expect_checkpoint(directory)


def _checkpointed_episodes(directory: str, without_gym_manifest: bool = False) -> list[str]:
    """Every episode any participant's manifest lists (the default restore scope)."""
    from ray_ckpt.storage import load_manifest, read_gym_manifest
    from ray_ckpt.storage.root.gym_manifest import has_gym_manifest, read_participant_manifests

    if not without_gym_manifest or has_gym_manifest(directory):
        gym = read_gym_manifest(directory)
        cid, members = gym.checkpoint_id, [(e.kind, e.instance) for e in gym.participants]
    else:
        cid, found = read_participant_manifests(directory)
        members = sorted(found)
        if not all(found[m].ours for m in members):
            # NeMo Gym's manifests do not list their episodes.
            raise InvalidRequest(
                f"the participant manifests in {directory} do not list their episodes: "
                "name them with --episode"
            )
    keys: set[str] = set()
    for kind, instance in members:
        manifest = load_manifest(directory, kind=kind, instance=instance, checkpoint_id=cid)
        keys.update(manifest.episodes)
    return sorted(keys)


@main.command()
@click.argument("rollout")
@click.argument("attempt", type=int)
@cluster_options
def retire(rollout: str, attempt: int, address: str, namespace: str, as_json: bool) -> None:
    """Stop and free ROLLOUT's attempts up to ATTEMPT everywhere (callers first)."""
    try:
        res = _connect(address, namespace).retire(rollout, attempt)
    except CheckpointError as exc:
        fail(exc, as_json)
    if as_json:
        emit(res)
        return
    for who, keys in sorted(res.retired.items()):
        click.echo(f"{who}: {', '.join(keys) or '-'}")


@main.command()
@click.argument("directory")
@json_option
def inspect(directory: str, as_json: bool) -> None:
    """Verify and summarise a checkpoint directory (no Ray needed)."""
    from coordination.cli.inspect import inspect_checkpoint, render_inspect

    expect_checkpoint(directory)
    report = inspect_checkpoint(directory)
    click.echo(msgspec.json.encode(report).decode() if as_json else render_inspect(report))
    sys.exit(0 if report.ok else 1)
