"""`ray-ckpt resume` and `ray-ckpt forget`, and how every command attaches.

The coordinator a command creates is detached: it outlives the command, so
`ray-ckpt checkpoint DIR --keep-open` (publish your own files meanwhile) is
followed by `ray-ckpt resume` in another command, and an open checkpoint is
never left to lapse because the CLI process that opened it exited.  A
coordinator that already runs (a training loop's) is used as it is; `connect`
warns when it was created with other options.
"""

from __future__ import annotations

import asyncio
from typing import Any

import click

from coordination.cli.output import CliError, ExitCode, cluster_options, emit, fail
from ray_ckpt.errors import CheckpointError


def connect_cli(address: str, namespace: str, *, create: bool = True) -> Any:
    """The namespace's coordinator, attached quietly and failing fast.

    `create=False` (status): only find one; none is a `CliError` (not
    found), never a coordinator made as a side effect."""
    import ray

    from coordination.client.connect import connect
    from ray_ckpt.errors import ParticipantUnavailable

    if not ray.is_initialized():
        attach_ray(address, namespace)
    where = None if address == "local" else address
    try:
        if create:
            return connect(namespace=namespace, address=where, detached=True)
        return connect(namespace=namespace, address=where, create=False)
    except ParticipantUnavailable as exc:
        if create:
            raise
        raise CliError(
            f"no coordinator in namespace {namespace!r}: nothing has checkpointed here yet",
            ExitCode.NOT_FOUND,
            hint="check --namespace (`ray list actors` shows the namespaces); "
            "`ray-ckpt checkpoint DIR` or a training loop's connect() creates it",
        ) from exc


# How long a cluster address may take to accept a connection: Ray itself
# retries an address with nothing behind it for minutes, printing as it goes.
PROBE_S = 3.0


def attach_ray(address: str, namespace: str) -> None:
    """`ray.init` for a command: an address with no Ray behind it is refused
    at once (`CliError`, unavailable) and Ray's connect messages stay quiet."""
    import logging

    import ray

    target: str | None = None
    if address != "local":
        target = _resolve(address)
        _probe(target, address)
    try:
        ray.init(
            address=target,
            namespace=namespace,
            ignore_reinit_error=True,
            log_to_driver=False,
            logging_level=logging.ERROR,
        )
    except ConnectionError as exc:
        raise _unavailable(address, str(exc)) from exc


def check_address(address: str) -> None:
    """Refuse (`CliError`) an address with no Ray behind it, at once; "local"
    (start one) passes."""
    if address != "local":
        _probe(_resolve(address), address)


def _resolve(address: str) -> str:
    """host:port (or a ray:// URI) of `address`; "auto" as Ray finds it."""
    if address.startswith("ray://") or address not in ("auto", ""):
        return address
    from ray._private.services import canonicalize_bootstrap_address_or_die

    try:
        return str(canonicalize_bootstrap_address_or_die(address))
    except ConnectionError as exc:
        raise _unavailable(address, "no running Ray cluster found on this machine") from exc


def _probe(target: str, asked: str) -> None:
    import socket

    hostport = target.removeprefix("ray://").rsplit("/", 1)[0]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise CliError(
            f"--address {asked!r} is not host:port, ray://host:port, auto or local",
            ExitCode.BAD_INPUT,
            hint="pass the address `ray start --head` printed (e.g. 127.0.0.1:6379)",
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S):
            pass
    except OSError as exc:
        raise _unavailable(asked, f"nothing answers at {hostport} ({exc.strerror or exc})") from exc


def _unavailable(address: str, why: str) -> CliError:
    return CliError(
        f"Ray is not reachable (--address {address}): {why}",
        ExitCode.UNAVAILABLE,
        hint="start Ray (`ray start --head`) or pass --address of a running cluster",
    )


# --- a fresh Gym for a restore ------------------------------------------------------


async def relaunch_registered(gym: Any, namespace: str) -> dict[str, str]:
    """Replace every registered host with a fresh one: same spec, same node,
    same port (so the servers' URLs, wired into each other at launch, hold),
    detached (it outlives this command).  member → its URL.

    All are checked before any is stopped: a member that is no host actor of
    ours (an HTTP-registered or sidecar server: only its own launcher can
    restart it) refuses the whole relaunch (`CliError`, conflict)."""
    import urllib.parse

    import msgspec
    import ray

    from ray_ckpt.hosting.host import relaunch_host, stop_host

    plan: list[tuple[str, Any, Any, str]] = []
    for key in sorted(await gym.adiscover()):
        try:
            old = await asyncio.to_thread(ray.get_actor, key, namespace=namespace)
            info = await old.ready.remote()
            spec = await old.server_spec.remote()
        except Exception as exc:
            raise CliError(
                f"cannot relaunch {key}: not a host actor started from a spec "
                f"({type(exc).__name__}); nothing was stopped",
                ExitCode.CONFLICT,
                hint="restart that server yourself, then run the restore without --relaunch",
            ) from exc
        port = urllib.parse.urlsplit(str(info["url"])).port or 0
        plan.append((key, old, msgspec.structs.replace(spec, port=port), str(info["node_id"])))
    for _key, old, _spec, _node in plan:
        await stop_host(old)
    urls: dict[str, str] = {}
    for key, _old, spec, node in plan:
        new = await relaunch_host(spec, namespace=namespace, node_id=node, lifetime="detached")
        urls[key] = str((await new.ready.remote())["url"])
    await gym.adiscover()
    return urls


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
