"""The programmatic handle: attach to a cluster, get the coordinator, drive it.

```python
from coordination import connect

gym = connect(namespace="rl-run-7")              # ray.init(address="auto") if needed
result = gym.checkpoint("/ckpt/step-100", scope=continued)
gym.restore("/ckpt/step-100", episode_ids=continued)

gym.register_assembler(collector, scope_method="in_flight_episodes")
gym.start_periodic("s3://bucket/run-7", every_s=600, keep_latest_k=3)
gym.restore("s3://bucket/run-7", "latest")       # after a crash, on a fresh fleet
```

Locations are absolute paths or URIs (`file://`, `s3://`, `gs://`); one that
is relative, of an unknown scheme or unreachable is refused (`InvalidRequest`
naming it) before anyone is paused.

Every method but the signal installers (`checkpoint_on_signal`,
`stop_checkpoint_on_signal`, which only install handlers) has an async twin
(`acheckpoint`, `arestore`, ...).  Errors are
the typed `ray_ckpt.errors` ones (e.g. `CoordinationFailed` with `failures`),
not Ray wrappers: `type(err)` is the project's class and `str(err)` its
message, never a remote traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal, overload

from coordination.actor.drain_control import DrainStatus, Relauncher
from coordination.client.handle_members import MemberCalls
from coordination.client.handle_receipts import ReceiptCalls
from coordination.client.pending import PendingCheckpoint
from coordination.client.remote import (
    Call,
    CoordinatorCalls,
    EpisodeLike,
    episodes,
    restore_args,
    twins,
)
from coordination.engine import roots
from coordination.engine.options import CheckpointOptions, Durability
from coordination.engine.results import (
    CheckpointResult,
    CommitResult,
    DurableResult,
    ForgetResult,
    PeriodicStatus,
    PrepareResult,
    RestoreResult,
    ResumeResult,
    RetireResult,
)
from coordination.triggers.periodic import DEFAULT_PREFIX
from coordination.triggers.signals import DEFAULT_GRACE_S as SIGNAL_GRACE_S
from coordination.triggers.signals import DEFAULT_SIGNALS, SignalCheckpointing
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.root.catalog import CheckpointEntry
from ray_ckpt.storage.root.retention import DEFAULT_GRACE_S, GcPlan

__all__ = ["CheckpointOptions", "CoordinatorHandle", "EpisodeLike", "episodes"]

# What a checkpoint returns: resumed and durable, or (`durability="async"`) pending.
Reply = CheckpointResult | PendingCheckpoint


class CoordinatorHandle(MemberCalls, ReceiptCalls):
    def __init__(self, actor: Any, namespace: str) -> None:
        self.actor = actor
        self.namespace = namespace
        self._calls = CoordinatorCalls(actor)

    # Each operation once (`_name`: the call it makes and how its reply is
    # shaped); `twins` makes the blocking `name` and its `aname` of it.

    # --- checkpoint ------------------------------------------------------------
    def _checkpoint(
        self,
        checkpoint_dir: str | CheckpointOptions,
        scope: Iterable[EpisodeLike] | None = None,
        *,
        resume: bool = True,
        stop: bool = False,
        prepare_s: float | None = None,
        commit_s: float | None = None,
        strict: bool = False,
        total_s: float | None = None,
        trigger: str = "manual",
        durability: Durability = "sync",
    ) -> Call[Reply]:
        """prepare → commit (scope) → Gym manifest → resume; `resume=False` keeps it
        open for publishing (call `resume()` after).  The result's `continued` and
        `restart` say which episodes of the scope have state and which start over;
        `strict=True` refuses (`RestartInScope`, nothing published) if any would
        start over.  `total_s` bounds the whole checkpoint: the phase deadlines
        are cut to fit, and one not ready to publish in time fails whole
        (`CoordinationFailed` with a `deadline_exceeded` failure; no Gym
        manifest, no `LATEST`).  `trigger` (manual, periodic, signal or drain)
        labels its metrics and its timeline.  `durability="async"` returns once
        the Gym is resumed (the records captured, still being written) with a
        `PendingCheckpoint`: its `durable()` returns when every write is
        durable and the Gym manifest written; publish your own checkpoint after.
        The options may come as one `CheckpointOptions` instead (no keywords
        then); the coordinator checks them before anyone is paused."""
        asked = CheckpointOptions(
            checkpoint_dir=str(checkpoint_dir),
            scope=episodes(scope),
            resume=resume,
            stop=stop,
            prepare_s=prepare_s,
            commit_s=commit_s,
            strict=strict,
            total_s=total_s,
            trigger=trigger,
            durability=durability,
        )
        if isinstance(checkpoint_dir, CheckpointOptions):
            # The engine refuses keywords beside a whole CheckpointOptions; the
            # handle only passes on the ones given (those not at their default).
            return Call("checkpoint", checkpoint_dir, **_given_keywords(asked)).then(
                self._pending_if_async
            )
        return Call("checkpoint", asked).then(self._pending_if_async)

    if TYPE_CHECKING:
        # What `twins` makes of `_checkpoint`, typed by `durability` (overloads
        # do not pass through a ParamSpec).
        @overload
        def checkpoint(self, checkpoint_dir: CheckpointOptions) -> Reply: ...
        @overload
        def checkpoint(
            self,
            checkpoint_dir: str,
            scope: Iterable[EpisodeLike] | None = None,
            *,
            resume: bool = True,
            stop: bool = False,
            prepare_s: float | None = None,
            commit_s: float | None = None,
            strict: bool = False,
            total_s: float | None = None,
            trigger: str = "manual",
            durability: Literal["sync"] = "sync",
        ) -> CheckpointResult: ...
        @overload
        def checkpoint(
            self,
            checkpoint_dir: str,
            scope: Iterable[EpisodeLike] | None = None,
            *,
            resume: bool = True,
            stop: bool = False,
            prepare_s: float | None = None,
            commit_s: float | None = None,
            strict: bool = False,
            total_s: float | None = None,
            trigger: str = "manual",
            durability: Literal["async"],
        ) -> PendingCheckpoint: ...
        def checkpoint(self, *args: Any, **kwargs: Any) -> Any: ...
        @overload
        async def acheckpoint(self, checkpoint_dir: CheckpointOptions) -> Reply: ...
        @overload
        async def acheckpoint(
            self,
            checkpoint_dir: str,
            scope: Iterable[EpisodeLike] | None = None,
            *,
            resume: bool = True,
            stop: bool = False,
            prepare_s: float | None = None,
            commit_s: float | None = None,
            strict: bool = False,
            total_s: float | None = None,
            trigger: str = "manual",
            durability: Literal["sync"] = "sync",
        ) -> CheckpointResult: ...
        @overload
        async def acheckpoint(
            self,
            checkpoint_dir: str,
            scope: Iterable[EpisodeLike] | None = None,
            *,
            resume: bool = True,
            stop: bool = False,
            prepare_s: float | None = None,
            commit_s: float | None = None,
            strict: bool = False,
            total_s: float | None = None,
            trigger: str = "manual",
            durability: Literal["async"],
        ) -> PendingCheckpoint: ...
        async def acheckpoint(self, *args: Any, **kwargs: Any) -> Any: ...
    else:
        checkpoint, acheckpoint = twins(_checkpoint)

    def _pending_if_async(self, res: CheckpointResult) -> Reply:
        if not res.pending:
            return res
        return PendingCheckpoint(res, self.actor.durable.remote(res.checkpoint_id))

    def _durable(self, checkpoint_id: str) -> Call[DurableResult]:
        """Wait for an asynchronous checkpoint by ID (the coordinator keeps the last 8)."""
        return Call("durable", checkpoint_id)

    durable, adurable = twins(_durable)

    def _prepare(self, deadline_s: float | None = None) -> Call[PrepareResult]:
        return Call("prepare", deadline_s)

    prepare, aprepare = twins(_prepare)

    def _commit(
        self,
        checkpoint_dir: str,
        scope: Iterable[EpisodeLike] | None = None,
        *,
        stop: bool = False,
        strict: bool = False,
        deadline_s: float | None = None,
    ) -> Call[CommitResult]:
        return Call("commit", str(checkpoint_dir), episodes(scope), stop, deadline_s, strict=strict)

    commit, acommit = twins(_commit)

    def _resume(self, deadline_s: float | None = None) -> Call[ResumeResult]:
        return Call("resume", deadline_s)

    resume, aresume = twins(_resume)

    def _renew(self) -> Call[dict[str, float | None]]:
        return Call("renew")

    renew, arenew = twins(_renew)

    # --- restore / retire / forget ---------------------------------------------
    def _restore(
        self,
        checkpoint_dir: str,
        episode_ids: Iterable[EpisodeLike] | Literal["latest"] | None = None,
        *,
        resume: bool = True,
        allow_without_gym_manifest: bool = False,
        latest: bool = False,
        deadline_s: float | None = None,
    ) -> Call[RestoreResult]:
        """Restore `episode_ids` (None: every episode the checkpoint lists).

        `restore(root, "latest")` (or `latest=True` with episodes): the newest
        complete checkpoint under `root` — the one `LATEST` names if it is
        complete, else the newest by time (`InvalidCheckpointState` if none).
        `allow_without_gym_manifest`: restore a directory NeMo Gym's controller
        wrote (participant manifests only, no ``gym/_manifest.json``), after
        checking each participant's manifest is there, complete and of one ID."""
        eps, latest = restore_args(episode_ids, latest)
        return Call(
            "restore",
            str(checkpoint_dir),
            eps,
            resume,
            deadline_s,
            allow_without_gym_manifest=allow_without_gym_manifest,
            latest=latest,
        )

    restore, arestore = twins(_restore)

    def _retire(
        self, rollout: str, attempt: int = 0, *, deadline_s: float | None = None
    ) -> Call[RetireResult]:
        return Call("retire", [EpisodeId(rollout, attempt)], deadline_s)

    retire, aretire = twins(_retire)

    def _retire_many(
        self, episode_ids: Iterable[EpisodeLike], *, deadline_s: float | None = None
    ) -> Call[RetireResult]:
        return Call("retire", episodes(episode_ids), deadline_s)

    retire_many, aretire_many = twins(_retire_many)

    def _forget(
        self, rollout_ids: Iterable[str], *, deadline_s: float | None = None
    ) -> Call[ForgetResult]:
        return Call("forget", list(rollout_ids), deadline_s)

    forget, aforget = twins(_forget)

    # --- periodic checkpoints, listing, retention --------------------------------
    def _start_periodic(
        self,
        root: str,
        *,
        every_s: float,
        keep_latest_k: int | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> Call[PeriodicStatus]:
        """Checkpoint every `every_s` into `<root>/<prefix><UTC time>` (scope: the
        assembler's `scope_method`, else every episode), keeping the
        `keep_latest_k` newest complete ones.  One loop at a time: another
        while one runs is `CheckpointConflict` (the same one again is a no-op)."""
        return Call("start_periodic", str(root), every_s, keep_latest_k, prefix)

    start_periodic, astart_periodic = twins(_start_periodic)

    def _stop_periodic(self) -> Call[PeriodicStatus | None]:
        """Stop after the checkpoint in flight; the final counts (None if none ran)."""
        return Call("stop_periodic")

    stop_periodic, astop_periodic = twins(_stop_periodic)

    def _list_checkpoints(self, root: str) -> Call[list[CheckpointEntry]]:
        """The checkpoints under `root`, oldest first (read here, not by the coordinator)."""
        return Call(roots.list_root, str(root))

    list_checkpoints, alist_checkpoints = twins(_list_checkpoints)

    def _gc(
        self, root: str, *, keep: int, dry_run: bool = False, grace_s: float = DEFAULT_GRACE_S
    ) -> Call[GcPlan]:
        """Keep the `keep` newest complete checkpoints under `root` (see
        `ray_ckpt.storage.retention`); `dry_run` only plans."""
        return Call(roots.gc_root, str(root), keep, dry_run=dry_run, grace_s=grace_s)

    gc, agc = twins(_gc)

    def _timeline(self, which: str = "latest") -> Call[dict[str, Any]]:
        """The newest checkpoint ("latest") or one of the last 16 checkpoints and
        restores by ID, as a Chrome trace / Perfetto JSON object (one row per
        participant); `InvalidRequest` if the coordinator no longer keeps it."""
        return Call("timeline", which)

    timeline, atimeline = twins(_timeline)

    # --- Ray node drains (coordination.actor.drain_control) ---------------------------
    def _start_drain_watch(
        self,
        root: str,
        relaunch: Relauncher,
        *,
        poll_s: float = 1.0,
        min_budget_s: float | None = None,
        margin_s: float | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> Call[DrainStatus]:
        """The coordinator watches Ray's draining nodes: when one holding Gym
        hosts drains, it checkpoints under `root` with `stop` inside the
        deadline, calls `relaunch(hosts, avoid)` (a picklable async callable,
        e.g. `participants.fleet_relaunch.FleetRelauncher`: every host fresh,
        none on `avoid`) and restores the whole Gym; `drain_status()` lists
        each outcome.  A deadline too short is reported; nothing is published."""
        return Call(
            "start_drain_watch", str(root), relaunch, poll_s, min_budget_s, margin_s, prefix
        )

    start_drain_watch, astart_drain_watch = twins(_start_drain_watch)

    def _stop_drain_watch(self) -> Call[DrainStatus]:
        return Call("stop_drain_watch")

    stop_drain_watch, astop_drain_watch = twins(_stop_drain_watch)

    def _drain_status(self) -> Call[DrainStatus]:
        return Call("drain_status")

    drain_status, adrain_status = twins(_drain_status)

    # --- checkpoints on a signal (coordination.triggers.signals): no async twin ----------
    def checkpoint_on_signal(
        self,
        root: str,
        scope: Iterable[EpisodeLike] | Callable[[], Iterable[EpisodeLike]] | None = None,
        signals: Iterable[int] = DEFAULT_SIGNALS,
        grace_s: float = SIGNAL_GRACE_S,
    ) -> SignalCheckpointing:
        """From the main thread: SIGUSR1 checkpoints under `root` and goes on,
        SIGTERM checkpoints with `stop` and exits, each inside `grace_s`
        (scope: a list, or a callable asked at the signal; None: the assembler's,
        as for periodic ones).  Replaces an earlier call's handlers."""
        self.stop_checkpoint_on_signal()
        on_signal = SignalCheckpointing(
            self, str(root), scope=scope, signals=signals, grace_s=grace_s
        ).install()
        self._on_signal: SignalCheckpointing | None = on_signal
        return on_signal

    def stop_checkpoint_on_signal(self) -> None:
        """Put the previous signal handlers back (a no-op if none are ours)."""
        current: SignalCheckpointing | None = getattr(self, "_on_signal", None)
        if current is not None:
            current.uninstall()
            self._on_signal = None


def _given_keywords(asked: CheckpointOptions) -> dict[str, Any]:
    """The keywords of a call that differ from `CheckpointOptions`' defaults."""
    default = CheckpointOptions(checkpoint_dir=asked.checkpoint_dir)
    return {
        name: getattr(asked, name)
        for name in asked.__struct_fields__
        if getattr(asked, name) != getattr(default, name)
    }
