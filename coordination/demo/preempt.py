"""The main job's preemption story: `--until-signal` and `--resume latest`.

`ray-ckpt demo --until-signal --checkpoint-dir ROOT` runs the rollouts with
signal checkpointing installed (`coordination.triggers.signals`) and prints
``in flight: N episodes, send SIGTERM or SIGUSR1`` once work is in flight in
every state.  SIGUSR1 checkpoints under ROOT and the rollouts go on; SIGTERM
checkpoints with `stop` and the job exits with status 128+15 after its
`--json` line (`stopped_by`, `checkpoint_id`, `episodes_in_flight`).  Each
signal checkpoint prints ``checkpoint on SIGNAL: ok LOCATION`` (or
``failed``).

`ray-ckpt demo --resume latest --checkpoint-dir ROOT` restores the checkpoint
`latest` picks under ROOT into a fresh fleet, continues every unfinished
episode as attempt + 1, and compares every result with an uninterrupted run
of the same seeds (`equal`, `episodes_continued`).  The two flags combine: a
resumed run can be interrupted again.

What the driver itself knew at a checkpoint (the seeds, each rollout's
attempt, the results already back) is the trainer's state, not the Gym's: it
is written beside the Gym's files as ``<checkpoint>/demo/driver.json`` once
the checkpoint is complete, as a trainer saves its own next to it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
from typing import Any

import msgspec

from coordination.demo.nodes import LocalRay, kill_coordinator, node_of
from coordination.demo.options import fleet_config
from coordination.demo.report import Ui
from coordination.demo.scenario import (
    Rollouts,
    resume_stopped_run,
    uninterrupted,
    wait_for_mixed_work,
)
from coordination.triggers.signals import STOP_SIGNALS, SignalCheckpoint, SignalCheckpointing
from participants.fleet import launch_fleet
from participants.rollout import result_digest
from ray_ckpt.control.client import data_session
from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage.blobstore.blobs import BlobMissing
from ray_ckpt.storage.blobstore.locations import open_location, split_location

DRIVER_KEY = "demo/driver.json"
EXIT_STOPPED = 128 + signal.SIGTERM


class DriverState(msgspec.Struct, frozen=True, kw_only=True):
    rollouts: int
    steps: int
    seed: int
    checkpoint_id: str
    trigger: str
    attempts: dict[str, int]
    results: dict[str, dict[str, Any]]


def write_driver_state(location: str, state: DriverState) -> None:
    root, name = split_location(location)
    open_location(root).replace(f"{name}/{DRIVER_KEY}", msgspec.json.encode(state))


def read_driver_state(location: str) -> DriverState:
    root, name = split_location(location)
    try:
        data = open_location(root).read(f"{name}/{DRIVER_KEY}")
    except BlobMissing:
        raise InvalidCheckpointState(
            f"{location} holds no {DRIVER_KEY}: not a checkpoint of `demo --until-signal`"
        ) from None
    return msgspec.json.decode(data, type=DriverState)


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def run_preempt(opts: Any, ui: Ui, local: LocalRay) -> tuple[dict[str, Any], int]:
    """The `--until-signal` / `--resume latest` run: (its JSON summary, exit status)."""
    from coordination.client.connect import connect

    root: str = opts.checkpoint_dir
    out: dict[str, Any] = {"nodes": local.nodes, "checkpoint_root": root}
    state: DriverState | None = None
    picked = ""
    expected: dict[str, str] = {}
    rollouts = Rollouts.make(opts.rollouts, opts.steps, opts.seed)
    if opts.resume:
        # The seeds are the interrupted run's: read them before anything runs.
        picked = await asyncio.to_thread(_latest_location, root)
        state = await asyncio.to_thread(read_driver_state, picked)
        handle = connect(namespace=opts.namespace, address=opts.address)
        rollouts = Rollouts.make(state.rollouts, state.steps, state.seed)
        base = Rollouts.make(state.rollouts, state.steps, state.seed)
        with ui.phase("uninterrupted run", total=state.rollouts):
            seeds = dataclasses.replace(opts, seed=state.seed)
            config = fleet_config(seeds, suffix="baseline", namespace=opts.namespace)
            expected = await uninterrupted(config, base, stagger_s=opts.stagger_s)
    else:
        handle = connect(namespace=opts.namespace, address=opts.address)
    seed = state.seed if state is not None else opts.seed
    config = fleet_config(dataclasses.replace(opts, seed=seed), suffix="", namespace=opts.namespace)
    placement = local.placement(avoid=await node_of(handle.actor) if local.workers else None)
    fleet = await launch_fleet(config, placement=placement)
    out["placement"] = fleet.placement
    stopped = asyncio.Event()
    writes: list[asyncio.Task[None]] = []
    checkpointing: SignalCheckpointing | None = None
    try:
        await handle.adiscover()
        async with data_session(1024, 512) as session:
            env = fleet.urls["environment"]
            if state is not None:
                # The checkpoint the driver's state was read from, not
                # `latest` asked again: the two must be one point in time.
                # The main run's phases, with their progress bars.
                with ui.phase("restore into a fresh fleet", total=None):
                    cont = await resume_stopped_run(handle, session, env, picked, state, rollouts)
                out.update(
                    resumed_from=cont.checkpoint_dir,
                    resumed_checkpoint_id=cont.checkpoint_id,
                    episodes_continued=len(cont.continued),
                    episodes_restarted=len(cont.restarted),
                    episodes_finished_before=len(state.results),
                    restart_bias=cont.restart_bias,
                    restart_bias_tokens=cont.restart_bias_tokens,
                )
            else:
                for i, rollout in enumerate(rollouts.tasks):
                    rollouts.start(session, env, rollout, delay_s=i * opts.stagger_s)
            if opts.until_signal:

                def written(outcome: SignalCheckpoint) -> None:
                    say(
                        f"checkpoint on {outcome.trigger}: "
                        f"{'ok' if outcome.ok else 'failed'} {outcome.location}"
                    )
                    if outcome.ok and outcome.checkpoint_id is not None:
                        snapshot = DriverState(
                            rollouts=len(rollouts.tasks),
                            steps=opts.steps if state is None else state.steps,
                            seed=seed,
                            checkpoint_id=outcome.checkpoint_id,
                            trigger=outcome.trigger,
                            attempts=dict(rollouts.attempts),
                            results=dict(rollouts.results),
                        )
                        writes.append(
                            asyncio.ensure_future(
                                asyncio.to_thread(write_driver_state, outcome.location, snapshot)
                            )
                        )

                checkpointing = SignalCheckpointing(
                    handle,
                    root,
                    # The driver is the assembler here: its unfinished episodes.
                    scope=rollouts.unfinished,
                    grace_s=opts.grace_s,
                    on_checkpoint=written,
                    on_stop=lambda _o: stopped.set(),
                ).install()
                # A resumed run may never show every state at once: not forever.
                seen = await wait_for_mixed_work(fleet, rollouts, 20.0)
                out["in_flight"] = seen
                say(f"in flight: {seen.get('episodes', 0)} episodes, send SIGTERM or SIGUSR1")
            label = "continued rollouts" if state is not None else "rollouts"
            with ui.phase(label, total=len(rollouts.unfinished())) as advance:
                rollouts.on_event = lambda _e, _r: advance()
                await _until_done_or_stopped(rollouts, stopped)
            if checkpointing is not None:
                # A signal that came as the last rollouts finished: its
                # checkpoint is still running; report it, never drop it.
                await checkpointing.wait()
            await asyncio.gather(*writes)
            if checkpointing is not None:
                checkpointing.uninstall()
                out["signal_checkpoints"] = [msgspec.to_builtins(o) for o in checkpointing.outcomes]
            if stopped.is_set() and checkpointing is not None:
                last = checkpointing.outcomes[-1]
                out.update(
                    stopped_by=last.trigger if last.stop else _stop_signal(last.joined),
                    checkpoint_id=last.checkpoint_id,
                    checkpoint_dir=last.location,
                    checkpoint_ok=last.ok,
                    episodes_in_flight=len(rollouts.unfinished()),
                    finished=len(rollouts.results),
                )
                await rollouts.abandon()  # their calls wait on paused servers
                return out, EXIT_STOPPED
            status = await handle.astatus()
            out["paused_after"] = sorted(
                p.participant for p in status.participants if p.phase not in (None, "idle")
            )
            out["open_checkpoint_after"] = status.open_checkpoint
        out.update(stopped_by=None, finished=len(rollouts.results))
        ok = not rollouts.failures and not out["paused_after"]
        if state is not None:
            lost = sorted(r for r in rollouts.tasks if r not in rollouts.results)
            different = sorted(
                r for r, res in rollouts.results.items() if result_digest(res) != expected.get(r)
            )
            equal = not lost and not different and len(expected) == len(rollouts.tasks)
            out.update(equal=equal, lost=lost, different=different)
            ok = ok and equal
        out["ok"] = ok
        return out, 0 if ok else 1
    finally:
        if checkpointing is not None:
            checkpointing.uninstall()
        await rollouts.abandon()
        fleet.kill()
        kill_coordinator(handle)


def _stop_signal(joined: list[str]) -> str | None:
    stops = {s.name for s in STOP_SIGNALS}
    return next((s for s in reversed(joined) if s in stops), None)


def _latest_location(root: str) -> str:
    from ray_ckpt.storage.root.catalog import latest_location

    return latest_location(root, open_location(root))[0]


async def _until_done_or_stopped(rollouts: Rollouts, stopped: asyncio.Event) -> None:
    """Every rollout replied, or a stop signal's checkpoint ended."""
    done = asyncio.ensure_future(rollouts.wait(timeout_s=600))
    stop = asyncio.ensure_future(stopped.wait())
    try:
        await asyncio.wait({done, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not done.done():
            done.cancel()
    if done.done() and not done.cancelled():
        done.result()
