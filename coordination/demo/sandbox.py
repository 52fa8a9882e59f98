"""`ray-ckpt demo --sandbox`: coding episodes whose state is a sandbox, crashed and continued.

The reference coding environment (`participants.servers.coding`) runs as one
`ParticipantHost`: each episode writes a small Python project into a sandbox
of its own, patches it and runs scripts over several steps, then runs its
tests; the reward is the fraction passing.  One episode also starts a
background process that stays alive across its steps.  The run:

1. an uninterrupted run of the same tasks, for the results to equal;
2. the episodes again on a checkpointed host; mid-flight (the background
   process alive, other episodes between steps) a checkpoint through the
   coordinator: the prepare reports the background episode as a restart
   (a copy of files is not a copy of a running process), the commit
   captures every other unfinished episode's sandbox with its record;
3. a crash: the host is killed (`ray.kill`), its sandboxes' files left
   behind as a crashed process leaves them;
4. a fresh host restores the checkpoint (every sandbox as a new generation,
   all or nothing), and every unfinished episode runs on as attempt + 1:
   from its restored boundary and sandbox, or, for the restart, from its
   task;
5. each episode's final files (digest of every file) and reward are
   compared with the uninterrupted run's.

Exit status 0 only if every episode's files and reward are equal, at least
one episode continued from the checkpoint, and the background episode was
restarted because its process was live (`SandboxReport.problems`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from rich.table import Table

from coordination.cli.output import format_bytes
from coordination.demo.nodes import kill_coordinator
from coordination.demo.options import DemoOptions
from coordination.demo.report import Ui
from coordination.demo.scenario import Rollouts, crash, fleet_stats, restore_and_continue
from participants.fleet import Fleet, FleetConfig
from participants.sandboxes import LIVE_PROCESS
from participants.servers.coding import MAX_PATCH_STEPS
from ray_ckpt.control.client import data_session
from ray_ckpt.gym_server.spec import ServerSpec, settings_dict
from ray_ckpt.hosting.host import relaunch_host, stop_host
from ray_ckpt.identity import EpisodeId

CODING_FACTORY = "participants.servers.coding:coding_server"
KIND = "environment"
# The rollout that starts a background process, and the long one
# (`BACKGROUND_EXTRA_STEPS` more patches than the others).  The checkpointed
# run starts it in the middle, so when the checkpoint lands (once every
# rollout has begun and its process runs) it is halfway through its patches,
# on a fast machine as on a slow one: started first, it raced the stagger,
# and on an idle machine its patches ran out (its process stopped by its
# tests) before the last rollout began; started last, the short ones before
# it were nearly all done.
BACKGROUND_ROLLOUT = "r0"
BACKGROUND_EXTRA_STEPS = 12
MAX_STEPS = MAX_PATCH_STEPS - BACKGROUND_EXTRA_STEPS


def sandbox_tasks(n: int, steps: int, seed: int) -> dict[str, dict[str, Any]]:
    """`n` coding tasks of `steps` patch steps; `BACKGROUND_ROLLOUT` starts a
    background process and runs longer."""
    tasks: dict[str, dict[str, Any]] = {}
    for i in range(n):
        rollout = f"r{i}"
        task: dict[str, Any] = {"task_id": f"coding-{seed}-{i}", "seed": seed * 1000 + i}
        if rollout == BACKGROUND_ROLLOUT:
            task.update(steps=steps + BACKGROUND_EXTRA_STEPS, background=True)
        else:
            task["steps"] = steps
        tasks[rollout] = task
    return tasks


def start_order(rollouts: Iterable[str]) -> list[str]:
    """The rollouts in the order the checkpointed run starts them: the
    background one in the middle (see `BACKGROUND_ROLLOUT`)."""
    every = list(rollouts)
    others = [r for r in every if r != BACKGROUND_ROLLOUT]
    middle = (len(every) - 1) // 2
    return [*others[:middle], BACKGROUND_ROLLOUT, *others[middle:]]


def coding_spec(config: FleetConfig, *, name: str, root: str, step_delay_s: float) -> ServerSpec:
    """The coding environment's host spec (sandboxes under `root`)."""
    return ServerSpec(
        kind=KIND,
        name=name,
        factory=CODING_FACTORY,
        options={"root": root, "step_delay_s": step_delay_s},
        settings=settings_dict(config.settings()),
    )


async def launch_coding(
    config: FleetConfig, spec: ServerSpec, *, start_timeout_s: float = 60.0
) -> Fleet:
    """Start (or start again, under the same name) the coding host; a `Fleet`
    of that one host, so the demo's crash and restore steps drive it."""
    handle = await relaunch_host(spec, namespace=config.namespace, timeout_s=start_timeout_s)
    fleet = Fleet(config)
    fleet.hosts[KIND] = handle
    try:
        info = await asyncio.wait_for(handle.ready.remote(), start_timeout_s)
    except BaseException:
        fleet.kill()
        raise
    fleet.info[KIND] = info
    fleet.urls[KIND] = info["url"]
    return fleet


@dataclass
class Outcome:
    """What an episode left: the digest of its files and its reward."""

    files_digest: str
    reward: float

    @classmethod
    def of(cls, result: dict[str, Any]) -> Outcome:
        return cls(str(result["files_digest"]), float(result["reward"]))


async def uninterrupted(
    config: FleetConfig, tasks: dict[str, dict[str, Any]], root: str, *, advance: Callable[[], None]
) -> tuple[dict[str, Outcome], float]:
    """Every task to its end on a host nobody checkpoints: outcomes and span."""
    base = msgspec.structs.replace(config, checkpoint=False, suffix="baseline")
    spec = coding_spec(base, name="ref-coding-baseline", root=root, step_delay_s=0.0)
    fleet = await launch_coding(base, spec)
    rollouts = Rollouts(dict(tasks))
    rollouts.on_event = lambda _e, _r: advance()
    try:
        async with data_session(256, 256) as session:
            for rollout in rollouts.tasks:
                rollouts.start(session, fleet.urls[KIND], rollout)
            await rollouts.wait(timeout_s=300)
    finally:
        await stop_host(fleet.hosts[KIND])
    if rollouts.failures:
        raise RuntimeError(f"uninterrupted run failed: {rollouts.failures}")
    return {r: Outcome.of(res) for r, res in rollouts.results.items()}, rollouts.span_s()


async def wait_mid_flight(fleet: Fleet, rollouts: Rollouts, timeout_s: float) -> dict[str, Any]:
    """Until every rollout has begun, the background episode's process runs
    and another episode is past its first patch (or the timeout); the stats."""
    deadline = time.monotonic() + timeout_s
    stats: dict[str, Any] = {}
    while time.monotonic() < deadline and len(rollouts.results) < len(rollouts.tasks):
        stats = (await fleet_stats(fleet))[KIND]
        progress: dict[str, Any] = stats.get("progress", {})
        begun = set(progress) | set(rollouts.results)
        past = [
            k
            for k, nxt in progress.items()
            if k != BACKGROUND_ROLLOUT and (nxt == "return" or (isinstance(nxt, int) and nxt >= 2))
        ]
        if (
            begun >= set(rollouts.tasks)
            and BACKGROUND_ROLLOUT in stats.get("processes_live", [])
            and (past or len(rollouts.tasks) == 1)
        ):
            break
        await asyncio.sleep(0.02)
    return stats


def blob_bytes(checkpoint_dir: str) -> int:
    """The bytes of the sandbox files a local checkpoint holds (its blobs)."""
    local = checkpoint_dir.removeprefix("file://")
    total = 0
    for top, _dirs, files in os.walk(os.path.join(local, "gym")):
        if os.path.basename(top) == "blobs":
            total += sum(os.path.getsize(os.path.join(top, f)) for f in files)
    return total


@dataclass
class SandboxReport:
    rollouts: int
    steps: int
    background: str = BACKGROUND_ROLLOUT
    in_scope: int = 0
    finished_before_crash: int = 0
    checkpoint_id: str = ""
    prepare_s: float = 0.0
    commit_s: float = 0.0
    restore_s: float = 0.0
    bytes: int = 0  # the checkpoint's: records and sandbox files
    sandbox_bytes: int = 0  # of which the sandbox files (blobs, one per content)
    prepare_restarts: list[str] = field(default_factory=list)
    # The episodes the checkpoint restarts because a sandbox process was
    # live at their boundary (`sandbox_restarts` of the host's stats).
    restarted_live: list[str] = field(default_factory=list)
    continued: list[str] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)
    equal: bool = False
    lost: list[str] = field(default_factory=list)
    different: list[str] = field(default_factory=list)
    rewards: dict[str, float] = field(default_factory=dict)
    sandboxes_left: int = 0  # sandboxes the restored host still holds at the end

    def compare(self, expected: dict[str, Outcome], rollouts: Rollouts) -> None:
        got = {r: Outcome.of(res) for r, res in rollouts.results.items()}
        self.lost = sorted(r for r in rollouts.tasks if r not in got)
        self.different = sorted(r for r, o in got.items() if o != expected.get(r))
        self.equal = not self.lost and not self.different and len(expected) == self.rollouts
        self.rewards = {r: o.reward for r, o in sorted(got.items())}

    def problems(self) -> list[str]:
        out: list[str] = []
        if not self.equal:
            out.append("files or rewards differ from the uninterrupted run (or were lost)")
        if not self.continued:
            out.append("no episode was continued from the checkpoint")
        if self.background not in self.restarted:
            out.append(f"the background episode {self.background} was not restarted")
        elif self.background not in {
            EpisodeId.from_capture_key(k).rollout_id for k in self.restarted_live
        }:
            out.append(f"{self.background} was not reported as restarted for a live process")
        return out

    @property
    def ok(self) -> bool:
        return not self.problems()

    def summary(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": self.problems(),
            "mode": "sandbox",
            "rollouts": self.rollouts,
            "steps": self.steps,
            "equal": self.equal,
            "episodes_in_flight_at_checkpoint": self.in_scope,
            "episodes_finished_before_crash": self.finished_before_crash,
            "episodes_continued": len(self.continued),
            "episodes_restarted": len(self.restarted),
            "restarted_live": self.restarted_live,
            "lost": self.lost,
            "different": self.different,
            "checkpoint_id": self.checkpoint_id,
            "checkpoint_s": round(self.prepare_s + self.commit_s, 4),
            "prepare_s": round(self.prepare_s, 4),
            "commit_s": round(self.commit_s, 4),
            "restore_s": round(self.restore_s, 4),
            "bytes": self.bytes,
            "sandbox_bytes": self.sandbox_bytes,
            "rewards": self.rewards,
            "sandboxes_left": self.sandboxes_left,
        }

    def table(self) -> Table:
        s = self.summary()
        table = Table(title="ray-ckpt demo --sandbox", show_header=False)
        table.add_column("what")
        table.add_column("value", justify="right")
        for label, value in (
            ("episodes x patch steps", f"{self.rollouts} x {self.steps}"),
            ("episodes in flight at checkpoint", str(self.in_scope)),
            ("finished before the crash", str(self.finished_before_crash)),
            ("episodes continued", str(len(self.continued))),
            ("episodes restarted", str(len(self.restarted))),
            ("restarted: a process was live", ", ".join(self.restarted_live) or "none"),
            ("checkpoint (prepare + commit)", f"{s['checkpoint_s']:.3f} s"),
            ("restore", f"{self.restore_s:.3f} s"),
            ("checkpoint size", format_bytes(self.bytes)),
            ("of which sandbox files", format_bytes(self.sandbox_bytes)),
            ("rewards", ", ".join(f"{r} {v:.2f}" for r, v in self.rewards.items()) or "-"),
            ("lost", ", ".join(self.lost) or "none"),
            ("files and rewards equal to uninterrupted run", "yes" if self.equal else "NO"),
            ("passed", "yes" if self.ok else "NO: " + "; ".join(self.problems())),
        ):
            table.add_row(label, value)
        return table


async def run_sandbox_demo(opts: DemoOptions, ui: Ui) -> SandboxReport:
    from coordination.client.connect import connect

    report = SandboxReport(rollouts=opts.rollouts, steps=opts.steps)
    tasks = sandbox_tasks(opts.rollouts, opts.steps, opts.seed)
    report.background = next(r for r, t in tasks.items() if t.get("background"))
    work = tempfile.mkdtemp(prefix="ray-ckpt-demo-sandbox-")
    ckpt_dir = opts.checkpoint_dir or os.path.join(work, "ckpt")
    config = FleetConfig(namespace=opts.namespace, token=uuid.uuid4().hex)
    try:
        with ui.phase("uninterrupted run", total=opts.rollouts) as advance:
            expected, span_s = await uninterrupted(
                config, tasks, os.path.join(work, "baseline"), advance=advance
            )
        handle = connect(namespace=opts.namespace, address=opts.address)
        # One root for the host and its replacement, as on one node: the
        # replacement takes the root over (what the dead process left there
        # goes, its background process with it) and restores new generations.
        spec = coding_spec(
            config,
            name="ref-coding",
            root=os.path.join(work, "sandboxes"),
            step_delay_s=opts.step_delay_s,
        )
        fleet = await launch_coding(config, spec)
        replacement: Fleet | None = None
        try:
            handle.discover()
            rollouts = Rollouts(dict(tasks))
            async with data_session(256, 256) as session:
                with ui.phase("episodes until mid-flight", total=None):
                    for i, rollout in enumerate(start_order(rollouts.tasks)):
                        rollouts.start(
                            session, fleet.urls[KIND], rollout, delay_s=i * opts.stagger_s
                        )
                    # The checkpointed run is slower (step delays): wait up to
                    # a generous bound, not the uninterrupted run's span.
                    await wait_mid_flight(fleet, rollouts, max(span_s, 1.0) * 20)
                with ui.phase("checkpoint (prepare, commit)", total=None):
                    prepared = await handle.aprepare()
                    report.prepare_restarts = sorted(
                        k for keys in prepared.restarts.values() for k in keys
                    )
                    # The scope: every unfinished episode but the restarts
                    # (a commit naming one is refused: it cannot continue).
                    skip = set(report.prepare_restarts)
                    report.in_scope = len(rollouts.in_flight())
                    scope = [e for e in rollouts.in_flight() if e.capture_key not in skip]
                    committed = await handle.acommit(ckpt_dir, scope)
                report.checkpoint_id = committed.checkpoint_id
                report.prepare_s, report.commit_s = prepared.seconds, committed.seconds
                report.bytes = sum(int(b or 0) for b in committed.bytes.values())
                report.sandbox_bytes = await asyncio.to_thread(blob_bytes, ckpt_dir)
                before = (await fleet_stats(fleet))[KIND]
                reasons: dict[str, str] = before.get("sandbox_restarts", {})
                report.restarted_live = sorted(
                    k for k, why in reasons.items() if why == LIVE_PROCESS
                )
                report.finished_before_crash = len(rollouts.results)

                with ui.phase("crash: kill the coding host", total=None):
                    await crash(fleet, rollouts)
                    await handle.aresume()  # the dead host's lease is moot

                with ui.phase("restore into a fresh host", total=None):
                    replacement = await launch_coding(config, spec)
                    cont = await restore_and_continue(
                        handle, replacement, session, ckpt_dir, scope, rollouts
                    )
                report.restore_s = cont.restore_s
                report.continued, report.restarted = sorted(cont.continued), sorted(cont.restarted)
                with ui.phase("continued episodes", total=len(rollouts.running)) as advance:
                    rollouts.on_event = lambda _e, _r: advance()
                    await rollouts.wait(timeout_s=300)
                after = (await fleet_stats(replacement))[KIND]
                report.sandboxes_left = int(after.get("sandboxes", 0))
            report.compare(expected, rollouts)
            return report
        finally:
            if replacement is not None:
                await stop_host(replacement.hosts[KIND])
            fleet.kill()
            kill_coordinator(handle)
    finally:
        # The crashed host's background process stops once its sandbox is gone.
        with contextlib.suppress(OSError):
            await asyncio.to_thread(shutil.rmtree, work, True)
