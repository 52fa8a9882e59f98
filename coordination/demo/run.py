"""`ray-ckpt demo`: the main job.

Reference servers of every kind run rollouts as `ParticipantHost` actors; a
checkpoint is taken mid-flight (work mid-generation, mid-tool, mid-verify and
parked); every Gym actor is killed; a fresh fleet restores and continues every
unfinished episode as attempt + 1; the final results must equal an
uninterrupted run of the same seeds.  With no `--address` it starts a local
Ray (loopback only) and stops it at the end; `--nodes N` makes that a local
cluster of N nodes the fleet spreads over, and `--kill-node` loses the node
of the environment and agent hosts instead of killing the actors
(`coordination/demo/nodes.py`); `--until-signal` and `--resume latest` tell
the preemption story (`coordination/demo/preempt.py`); `--nodes 3 --partition`
cuts a node off the network instead (`coordination/demo/partition.py`);
`--sandbox` runs coding episodes whose state is a sandbox, one with a live
background process (`coordination/demo/sandbox.py`).
Exit status 0 only if every result is equal, nothing was lost, and the
checkpoint was put to the test: something was in flight when it was taken
and some episode continued from it (`DemoReport.problems`).

Also runnable as `python -m coordination.demo` (e.g. under `ray job submit`).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
import uuid
from typing import Any

import click
import msgspec

from coordination.cli.output import S3_HINT, CliError, ExitCode, debugging, report_error
from coordination.demo.nodes import LocalRay, kill_coordinator, node_of, start_ray
from coordination.demo.options import DemoOptions, fleet_config
from coordination.demo.report import DemoReport, Ui
from coordination.demo.scenario import (
    Rollouts,
    baseline,
    crash,
    fleet_stats,
    restore_and_continue,
    wait_for_mixed_work,
)
from participants.fleet import launch_fleet
from ray_ckpt.control.client import data_session


def lost_replies_wanted(opts: DemoOptions) -> int:
    """How many replies the driver loses: `--lose-replies`, at most a quarter
    of the rollouts (none below four: rollouts of one length finish together,
    so waiting for one to finish left nothing in flight at the checkpoint)."""
    if not opts.receipts:
        return 0
    return min(opts.lose_replies, opts.rollouts // 4)


async def _wait_for_lost(rollouts: Rollouts, n: int, timeout_s: float) -> None:
    """Until `n` replies were lost, nothing is left running, or the timeout."""
    deadline = time.monotonic() + timeout_s
    while len(rollouts.lost_replies) < n and time.monotonic() < deadline:
        if len(rollouts.results) + len(rollouts.lost_replies) >= len(rollouts.tasks):
            return
        await asyncio.sleep(0.02)


async def run_demo(opts: DemoOptions, ui: Ui, ray_nodes: LocalRay | None = None) -> DemoReport:
    from coordination.client.connect import connect

    ns = opts.namespace
    local = ray_nodes or LocalRay(started=False)
    report = DemoReport(rollouts=opts.rollouts, steps=opts.steps, nodes=local.nodes)
    report.workers = opts.workers
    report.restore_workers = opts.restore_workers or opts.workers
    ckpt_dir = opts.checkpoint_dir or tempfile.mkdtemp(prefix="ray-ckpt-demo-")

    # 1. The uninterrupted run the checkpointed one must equal.
    with ui.phase("uninterrupted run", total=opts.rollouts) as advance:
        first = await baseline(
            fleet_config(opts, suffix="baseline", namespace=ns),
            opts.rollouts,
            opts.steps,
            opts.seed,
            stagger_s=opts.stagger_s,
            advance=advance,
        )
    expected, base_stats, run_s = first.expected, first.stats, first.span_s

    handle = connect(namespace=ns, address=opts.address)
    config = fleet_config(opts, suffix="", namespace=ns, receipts=opts.receipts)
    placement = local.placement(avoid=await node_of(handle.actor) if local.workers else None)
    fleet = await launch_fleet(config, placement=placement)
    report.placement["before"] = fleet.placement
    replacement = None
    try:
        handle.discover()
        rollouts = Rollouts.make(opts.rollouts, opts.steps, opts.seed)
        async with data_session(1024, 512) as session:
            # 2. Rollouts, then a checkpoint while work is in flight.
            with ui.phase("rollouts until mid-flight", total=None):
                to_lose = lost_replies_wanted(opts)
                rollouts.lose_next = to_lose
                for i, rollout in enumerate(rollouts.tasks):
                    rollouts.start(
                        session, fleet.urls["environment"], rollout, delay_s=i * opts.stagger_s
                    )
                # At the latest 60% through (as long as the uninterrupted
                # run took), so short runs still checkpoint mid-flight.
                # The first replies are lost (a crash of the driver's calls would
                # lose them the same way) while the rest are still in flight.
                await _wait_for_lost(rollouts, to_lose, run_s * 0.6)
                report.in_flight = await wait_for_mixed_work(fleet, rollouts, run_s * 0.6)
            # Replies are lost before the checkpoint only (the checkpoint carries
            # those results); what the driver stored, its store committed.
            rollouts.lose_next = 0
            stored = rollouts.take_receipts()
            if stored:
                await handle.aack(stored)
            if opts.durability == "async":
                with ui.phase("checkpoint (async: resumed once captured)", total=None):
                    scope = rollouts.in_flight()
                    t0 = time.monotonic()
                    pending = await handle.acheckpoint(ckpt_dir, scope, durability="async")
                    report.resumed_s = time.monotonic() - t0
                    done = await pending.adurable()
                    report.durable_s = time.monotonic() - t0
                report.add_async_checkpoint(pending.result, done)
                committed_id = pending.checkpoint_id
                # Rollouts ran on through the write: those finished since are done.
                still = {e.rollout_id for e in rollouts.unfinished()}
                scope = [e for e in scope if e.rollout_id in still]
            else:
                with ui.phase("checkpoint (prepare, commit)", total=None):
                    prepared = await handle.aprepare()
                    scope = rollouts.in_flight()
                    committed = await handle.acommit(ckpt_dir, scope)
                report.add_checkpoint(prepared, committed)
                committed_id = committed.checkpoint_id
            before = await fleet_stats(fleet)
            report.workers_serving = {
                k: int(v.get("workers_answering", 1)) for k, v in before.items()
            }
            report.finished_before_crash = len(rollouts.results)

            # 3. A crash before resume: every Gym actor dies (with --kill-node
            # the edge node goes away, and the survivors are replaced too: a
            # restore installs one point in time into fresh processes).
            what = "crash: lose the edge node" if opts.kill_node else "crash: kill every Gym actor"
            with ui.phase(what, total=None):
                if opts.kill_node:
                    report.node_killed = local.kill_edge()
                    placement = local.after_loss(placement, report.node_killed)
                await crash(fleet, rollouts)
                if opts.durability == "sync":
                    # The dead hosts' leases are moot; clear the open checkpoint.
                    await handle.aresume()

            # 4. A fresh fleet restores and continues every unfinished rollout.
            with ui.phase("restore into a fresh fleet", total=None):
                restored_as = msgspec.structs.replace(
                    config, workers=opts.restore_workers or opts.workers
                )
                replacement = await launch_fleet(restored_as, placement=placement)
                report.placement["after"] = replacement.placement
                cont = await restore_and_continue(
                    handle, replacement, session, ckpt_dir, scope, rollouts, collect=opts.receipts
                )
            report.add_restore(cont)
            report.completion_receipts = opts.receipts
            report.replies_lost = len(rollouts.lost_replies)
            if opts.timeline:
                # The checkpoint's picture, its resume to the dead hosts included.
                trace = await handle.atimeline(committed_id)
                await asyncio.to_thread(write_json, opts.timeline, trace)
                report.timeline = opts.timeline
            remaining = len(rollouts.running)
            with ui.phase("continued rollouts", total=remaining) as advance:
                rollouts.on_event = lambda _e, _r: advance()
                await rollouts.wait(timeout_s=300)
            after = await fleet_stats(replacement)
            stored = rollouts.take_receipts()
            if stored:
                await handle.aack(stored)
        report.compare(expected, rollouts, base=base_stats, before=before, after=after)
        return report
    finally:
        if replacement is not None:
            await replacement.stop()
        fleet.kill()
        kill_coordinator(handle)


def write_json(path: str, value: Any) -> None:
    with open(path, "wb") as f:
        f.write(msgspec.json.encode(value))


@click.command(name="demo")
@click.option(
    "--address", default=None, help='Ray cluster to attach to ("auto"); default: start one.'
)
@click.option("--namespace", default=None, help="Ray namespace (default: a fresh one).")
@click.option("--rollouts", default=8, show_default=True, type=click.IntRange(1, 256))
@click.option("--steps", default=4, show_default=True, type=click.IntRange(1, 64))
@click.option("--seed", default=7, show_default=True, type=int)
@click.option("--checkpoint-dir", default=None, help="Where the checkpoint goes (default: temp).")
@click.option("--token-delay", "token_delay_s", default=0.04, show_default=True, type=float)
@click.option("--step-delay", "step_delay_s", default=0.1, show_default=True, type=float)
@click.option("--verify-delay", "verify_delay_s", default=0.15, show_default=True, type=float)
@click.option("--stagger", "stagger_s", default=0.35, show_default=True, type=float)
@click.option(
    "--nodes",
    default=1,
    show_default=True,
    type=click.IntRange(1, 8),
    help="Local Ray nodes to start (no --address): a head and N-1 workers; the fleet spreads.",
)
@click.option(
    "--kill-node",
    is_flag=True,
    help="Lose the node of the environment and agent hosts after the checkpoint (needs --nodes>1).",
)
@click.option(
    "--until-signal",
    is_flag=True,
    help="Run with signal checkpointing under --checkpoint-dir: SIGUSR1 checkpoints and "
    "goes on, SIGTERM checkpoints and stops (coordination/demo/preempt.py).",
)
@click.option(
    "--resume",
    type=click.Choice(["latest"]),
    default=None,
    help="Continue the stopped run whose checkpoints are under --checkpoint-dir.",
)
@click.option(
    "--grace",
    "grace_s",
    default=25.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="With --until-signal: the seconds a signal's checkpoint must fit in.",
)
@click.option(
    "--durability",
    type=click.Choice(["sync", "async"]),
    default="sync",
    show_default=True,
    help="async: the Gym resumes once captured and the write runs in the background "
    "(reports the time to resumed and to durable).",
)
@click.option(
    "--timeline",
    default=None,
    type=click.Path(dir_okay=False),
    help="Write the checkpoint as a Chrome trace / Perfetto JSON to this file.",
)
@click.option(
    "--receipts/--no-receipts",
    default=True,
    show_default=True,
    help="Completion receipts: the Gym holds each result until the driver acks it.",
)
@click.option(
    "--lose-replies",
    default=2,
    show_default=True,
    type=click.IntRange(min=0),
    help="With receipts: the driver loses the first N replies; collect() recovers them.",
)
@click.option(
    "--workers",
    default=1,
    show_default=True,
    type=click.IntRange(1, 8),
    help="Worker processes per Gym server, under one host each (rollout-affine).",
)
@click.option(
    "--restore-workers",
    default=None,
    type=click.IntRange(1, 8),
    help="Worker processes per server of the fresh fleet the restore goes to (default: --workers).",
)
@click.option(
    "--partition",
    is_flag=True,
    help="With --nodes 3: the nodes in network namespaces; cut the environment's node "
    "mid-flight, restore, heal, show the zombie fenced (needs root, ip and nft).",
)
@click.option(
    "--sandbox",
    is_flag=True,
    help="Coding episodes that patch and test a project in sandboxes (one with a live "
    "background process, reported as a restart); crash mid-flight, restore, compare files.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object as the last line.")
def demo_cli(as_json: bool, namespace: str | None, **kwargs: Any) -> None:
    """Checkpoint a fleet mid-flight, crash it, restore, continue, compare."""
    opts = DemoOptions(namespace=namespace or f"ray-ckpt-demo-{uuid.uuid4().hex[:8]}", **kwargs)
    if opts.kill_node and (opts.nodes < 2 or opts.address is not None):
        raise click.UsageError("--kill-node needs --nodes 2 or more on the cluster the demo starts")
    if opts.nodes > 1 and opts.address is not None:
        raise click.UsageError("--nodes starts a local cluster: not with --address")
    if opts.sandbox:
        _sandbox(opts, as_json=as_json)
    if opts.partition:
        _partition(opts, as_json=as_json)
    preempt = opts.until_signal or opts.resume is not None
    if preempt and (opts.kill_node or not opts.checkpoint_dir):
        raise click.UsageError(
            "--until-signal and --resume need --checkpoint-dir (the root) and no --kill-node"
        )
    if preempt:
        _check_root(str(opts.checkpoint_dir), write=opts.until_signal)
    elif opts.checkpoint_dir is not None:
        # Before the first run, not minutes later at the checkpoint: an
        # unreachable or unconfigured store (s3:// with no endpoint or
        # credentials) is refused now, nothing started.
        _check_root(opts.checkpoint_dir, write=True)
    if opts.address is not None:
        from coordination.cli.ops import check_address

        check_address(opts.address)  # not minutes of Ray's retries
    ui = Ui(stderr=True)
    local = start_ray(opts.address, opts.namespace, opts.nodes)
    if preempt:
        from coordination.demo.preempt import run_preempt
        from ray_ckpt.errors import CheckpointError

        try:
            summary, status = asyncio.run(run_preempt(opts, ui, local))
        except CheckpointError as exc:  # e.g. no checkpoint of ours under the root
            summary = {"ok": False, "error": {"code": exc.code, "detail": exc.detail}}
            status = int(report_error(exc))
        finally:
            local.stop()
        from coordination.demo.report import preempt_table

        # Every mode prints its table (the JSON, asked for, is the last line).
        ui.out.print(preempt_table(summary))
        if as_json:
            sys.stdout.write(msgspec.json.encode(summary).decode() + "\n")
        sys.exit(status)
    try:
        report = asyncio.run(run_demo(opts, ui, local))
    finally:
        local.stop()
    sys.exit(finish(report, ui, as_json=as_json))


def _partition(opts: DemoOptions, *, as_json: bool) -> None:
    """`--nodes 3 --partition`: its own cluster in network namespaces."""
    from coordination.demo import partition

    if opts.nodes != partition.NODES or opts.address is not None:
        raise click.UsageError("--partition needs --nodes 3 (a head and two workers it starts)")
    others = {
        "--kill-node": opts.kill_node,
        "--until-signal": opts.until_signal,
        "--resume": opts.resume is not None,
        "--durability async": opts.durability != "sync",
        "--timeline": opts.timeline is not None,
    }
    if any(others.values()):
        clash = ", ".join(k for k, v in others.items() if v)
        raise click.UsageError(f"--partition tells its own story: not with {clash}")
    if opts.checkpoint_dir is not None:
        if "://" in opts.checkpoint_dir and not opts.checkpoint_dir.startswith("file://"):
            # The nodes' namespaces route nowhere beyond the test bed.
            raise click.UsageError("--partition needs a local --checkpoint-dir (no store URI)")
        _check_root(opts.checkpoint_dir, write=True)
    # Before anything starts: no root, `ip` or `nft` is one error line.
    partition.check_capabilities()
    ui = Ui(stderr=True)
    report = partition.run_partition(opts, ui)
    sys.exit(finish(report, ui, as_json=as_json))


def _sandbox(opts: DemoOptions, *, as_json: bool) -> None:
    """`--sandbox`: the coding environment alone, on one host (no receipts)."""
    from coordination.demo.sandbox import MAX_STEPS, run_sandbox_demo

    others = {
        "--nodes": opts.nodes != 1,
        "--partition": opts.partition,
        "--kill-node": opts.kill_node,
        "--until-signal": opts.until_signal,
        "--resume": opts.resume is not None,
        "--durability async": opts.durability != "sync",
        "--timeline": opts.timeline is not None,
        "--workers": opts.workers != 1 or opts.restore_workers is not None,
    }
    if any(others.values()):
        clash = ", ".join(k for k, v in others.items() if v)
        raise click.UsageError(f"--sandbox tells its own story: not with {clash}")
    if opts.steps > MAX_STEPS:
        raise click.UsageError(f"--sandbox runs at most {MAX_STEPS} steps per episode")
    if opts.checkpoint_dir is not None:
        if "://" in opts.checkpoint_dir and not opts.checkpoint_dir.startswith("file://"):
            # The sandbox bytes are counted on disk, and the demo is one machine's.
            raise click.UsageError("--sandbox needs a local --checkpoint-dir (no store URI)")
        _check_root(opts.checkpoint_dir, write=True)
    if opts.address is not None:
        from coordination.cli.ops import check_address

        check_address(opts.address)
    ui = Ui(stderr=True)
    local = start_ray(opts.address, opts.namespace, 1)
    try:
        report = asyncio.run(run_sandbox_demo(opts, ui))
    finally:
        local.stop()
    ui.out.print(report.table())
    if as_json:
        sys.stdout.write(msgspec.json.encode(report.summary()).decode() + "\n")
    if report.problems():
        sys.stderr.write(f"demo failed: {'; '.join(report.problems())}\n")
    sys.exit(0 if report.ok else 1)


def _check_root(root: str, *, write: bool) -> None:
    """A root that cannot be used is refused before Ray starts (nothing changes)."""
    from ray_ckpt.errors import CheckpointError
    from ray_ckpt.storage.blobstore.locations import check_location

    try:
        check_location(root, for_write=write)
    except CheckpointError as exc:
        hint = S3_HINT if "://" in root and not root.startswith("file://") else None
        raise CliError(
            f"--checkpoint-dir: {exc.detail}",
            ExitCode.BAD_INPUT,
            hint=hint or "give an absolute directory this machine can write (or a reachable URI)",
            code=exc.code,
        ) from None


def finish(report: DemoReport, ui: Ui, *, as_json: bool) -> int:
    """Show the report; the exit status (0 only if the report passed)."""
    ui.print_report(report)
    if as_json:
        sys.stdout.write(msgspec.json.encode(report.summary()).decode() + "\n")
    if report.problems():
        # One line, as every error of the command line.
        sys.stderr.write(f"demo failed: {'; '.join(report.problems())}\n")
    return 0 if report.ok else 1


def demo_command_main(args: list[str]) -> int:
    """Entry for `ray-ckpt demo ARGS…`."""
    try:
        demo_cli.main(args=args, prog_name="ray-ckpt demo", standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    except (click.ClickException, CliError) as exc:
        return int(report_error(exc))
    except Exception as exc:  # `python -m coordination.demo` has no group to say it
        return int(report_error(exc, debug=debugging()))
    return 0
