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

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, Literal, overload

from coordination import roots
from coordination.connect import aconnect, connect
from coordination.drain_control import DrainStatus, Relauncher
from coordination.handle_members import MemberCalls
from coordination.handle_receipts import ReceiptCalls
from coordination.pending import PendingCheckpoint
from coordination.periodic import DEFAULT_PREFIX
from coordination.remote import CoordinatorCalls, EpisodeLike, episodes, restore_args
from coordination.results import (
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
from coordination.signals import DEFAULT_GRACE_S as SIGNAL_GRACE_S
from coordination.signals import DEFAULT_SIGNALS, SignalCheckpointing
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.root.catalog import CheckpointEntry
from ray_ckpt.storage.root.retention import DEFAULT_GRACE_S, GcPlan

__all__ = ["CoordinatorHandle", "EpisodeLike", "aconnect", "connect", "episodes"]


class CoordinatorHandle(MemberCalls, ReceiptCalls):
    def __init__(self, actor: Any, namespace: str) -> None:
        self.actor = actor
        self.namespace = namespace
        calls = CoordinatorCalls(actor)
        self._sync, self._async = calls.sync, calls.call

    # --- checkpoint ------------------------------------------------------------
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
        durability: Literal["sync", "async"] = "sync",
    ) -> CheckpointResult | PendingCheckpoint:
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
        durable and the Gym manifest written; publish your own checkpoint after."""
        res: CheckpointResult = self._sync(
            "checkpoint",
            str(checkpoint_dir),
            episodes(scope),
            resume,
            stop,
            prepare_s,
            commit_s,
            strict,
            total_s,
            trigger,
            durability,
        )
        return self._pending(res) if res.pending else res

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
        durability: Literal["sync", "async"] = "sync",
    ) -> CheckpointResult | PendingCheckpoint:
        res: CheckpointResult = await self._async(
            "checkpoint",
            str(checkpoint_dir),
            episodes(scope),
            resume,
            stop,
            prepare_s,
            commit_s,
            strict,
            total_s,
            trigger,
            durability,
        )
        return self._pending(res) if res.pending else res

    def _pending(self, res: CheckpointResult) -> PendingCheckpoint:
        return PendingCheckpoint(res, self.actor.durable.remote(res.checkpoint_id))

    def durable(self, checkpoint_id: str) -> DurableResult:
        """Wait for an asynchronous checkpoint by ID (the coordinator keeps the last 8)."""
        res: DurableResult = self._sync("durable", checkpoint_id)
        return res

    async def adurable(self, checkpoint_id: str) -> DurableResult:
        res: DurableResult = await self._async("durable", checkpoint_id)
        return res

    def prepare(self, deadline_s: float | None = None) -> PrepareResult:
        res: PrepareResult = self._sync("prepare", deadline_s)
        return res

    async def aprepare(self, deadline_s: float | None = None) -> PrepareResult:
        res: PrepareResult = await self._async("prepare", deadline_s)
        return res

    def commit(
        self,
        checkpoint_dir: str,
        scope: Iterable[EpisodeLike] | None = None,
        *,
        stop: bool = False,
        strict: bool = False,
        deadline_s: float | None = None,
    ) -> CommitResult:
        res: CommitResult = self._sync(
            "commit", str(checkpoint_dir), episodes(scope), stop, deadline_s, strict=strict
        )
        return res

    async def acommit(
        self,
        checkpoint_dir: str,
        scope: Iterable[EpisodeLike] | None = None,
        *,
        stop: bool = False,
        strict: bool = False,
        deadline_s: float | None = None,
    ) -> CommitResult:
        res: CommitResult = await self._async(
            "commit", str(checkpoint_dir), episodes(scope), stop, deadline_s, strict=strict
        )
        return res

    def resume(self, deadline_s: float | None = None) -> ResumeResult:
        res: ResumeResult = self._sync("resume", deadline_s)
        return res

    async def aresume(self, deadline_s: float | None = None) -> ResumeResult:
        res: ResumeResult = await self._async("resume", deadline_s)
        return res

    def renew(self) -> dict[str, float | None]:
        res: dict[str, float | None] = self._sync("renew")
        return res

    async def arenew(self) -> dict[str, float | None]:
        res: dict[str, float | None] = await self._async("renew")
        return res

    # --- restore / retire / forget ---------------------------------------------
    def restore(
        self,
        checkpoint_dir: str,
        episode_ids: Iterable[EpisodeLike] | Literal["latest"] | None = None,
        *,
        resume: bool = True,
        allow_without_gym_manifest: bool = False,
        latest: bool = False,
        deadline_s: float | None = None,
    ) -> RestoreResult:
        """Restore `episode_ids` (None: every episode the checkpoint lists).

        `restore(root, "latest")` (or `latest=True` with episodes): the newest
        complete checkpoint under `root` — the one `LATEST` names if it is
        complete, else the newest by time (`InvalidCheckpointState` if none).
        `allow_without_gym_manifest`: restore a directory NeMo Gym's controller
        wrote (participant manifests only, no ``gym/_manifest.json``), after
        checking each participant's manifest is there, complete and of one ID."""
        eps, latest = restore_args(episode_ids, latest)
        res: RestoreResult = self._sync(
            "restore",
            str(checkpoint_dir),
            eps,
            resume,
            deadline_s,
            allow_without_gym_manifest=allow_without_gym_manifest,
            latest=latest,
        )
        return res

    async def arestore(
        self,
        checkpoint_dir: str,
        episode_ids: Iterable[EpisodeLike] | Literal["latest"] | None = None,
        *,
        resume: bool = True,
        allow_without_gym_manifest: bool = False,
        latest: bool = False,
        deadline_s: float | None = None,
    ) -> RestoreResult:
        eps, latest = restore_args(episode_ids, latest)
        res: RestoreResult = await self._async(
            "restore",
            str(checkpoint_dir),
            eps,
            resume,
            deadline_s,
            allow_without_gym_manifest=allow_without_gym_manifest,
            latest=latest,
        )
        return res

    # --- periodic checkpoints, listing, retention --------------------------------
    def start_periodic(
        self,
        root: str,
        *,
        every_s: float,
        keep_latest_k: int | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> PeriodicStatus:
        """Checkpoint every `every_s` into `<root>/<prefix><UTC time>` (scope: the
        assembler's `scope_method`, else every episode), keeping the
        `keep_latest_k` newest complete ones.  One loop at a time: another
        while one runs is `CheckpointConflict` (the same one again is a no-op)."""
        res: PeriodicStatus = self._sync(
            "start_periodic", str(root), every_s, keep_latest_k, prefix
        )
        return res

    async def astart_periodic(
        self,
        root: str,
        *,
        every_s: float,
        keep_latest_k: int | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> PeriodicStatus:
        res: PeriodicStatus = await self._async(
            "start_periodic", str(root), every_s, keep_latest_k, prefix
        )
        return res

    def stop_periodic(self) -> PeriodicStatus | None:
        """Stop after the checkpoint in flight; the final counts (None if none ran)."""
        res: PeriodicStatus | None = self._sync("stop_periodic")
        return res

    async def astop_periodic(self) -> PeriodicStatus | None:
        res: PeriodicStatus | None = await self._async("stop_periodic")
        return res

    # --- Ray node drains (coordination.drain_control) ---------------------------
    def start_drain_watch(
        self,
        root: str,
        relaunch: Relauncher,
        *,
        poll_s: float = 1.0,
        min_budget_s: float | None = None,
        margin_s: float | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> DrainStatus:
        """The coordinator watches Ray's draining nodes: when one holding Gym
        hosts drains, it checkpoints under `root` with `stop` inside the
        deadline, calls `relaunch(hosts, avoid)` (a picklable async callable,
        e.g. `participants.fleet_relaunch.FleetRelauncher`: every host fresh,
        none on `avoid`) and restores the whole Gym; `drain_status()` lists
        each outcome.  A deadline too short is reported; nothing is published."""
        res: DrainStatus = self._sync(
            "start_drain_watch", str(root), relaunch, poll_s, min_budget_s, margin_s, prefix
        )
        return res

    async def astart_drain_watch(
        self,
        root: str,
        relaunch: Relauncher,
        *,
        poll_s: float = 1.0,
        min_budget_s: float | None = None,
        margin_s: float | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> DrainStatus:
        res: DrainStatus = await self._async(
            "start_drain_watch", str(root), relaunch, poll_s, min_budget_s, margin_s, prefix
        )
        return res

    def stop_drain_watch(self) -> DrainStatus:
        res: DrainStatus = self._sync("stop_drain_watch")
        return res

    async def astop_drain_watch(self) -> DrainStatus:
        res: DrainStatus = await self._async("stop_drain_watch")
        return res

    def drain_status(self) -> DrainStatus:
        res: DrainStatus = self._sync("drain_status")
        return res

    async def adrain_status(self) -> DrainStatus:
        res: DrainStatus = await self._async("drain_status")
        return res

    # --- checkpoints on a signal (coordination.signals) --------------------------
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

    def list_checkpoints(self, root: str) -> list[CheckpointEntry]:
        """The checkpoints under `root`, oldest first (read here, not by the coordinator)."""
        return roots.list_root(str(root))

    async def alist_checkpoints(self, root: str) -> list[CheckpointEntry]:
        return await asyncio.to_thread(roots.list_root, str(root))

    def gc(
        self, root: str, *, keep: int, dry_run: bool = False, grace_s: float = DEFAULT_GRACE_S
    ) -> GcPlan:
        """Keep the `keep` newest complete checkpoints under `root` (see
        `ray_ckpt.storage.root.retention`); `dry_run` only plans."""
        return roots.gc_root(str(root), keep, dry_run=dry_run, grace_s=grace_s)

    async def agc(
        self, root: str, *, keep: int, dry_run: bool = False, grace_s: float = DEFAULT_GRACE_S
    ) -> GcPlan:
        return await asyncio.to_thread(
            roots.gc_root, str(root), keep, dry_run=dry_run, grace_s=grace_s
        )

    def retire(
        self, rollout: str, attempt: int = 0, *, deadline_s: float | None = None
    ) -> RetireResult:
        res: RetireResult = self._sync("retire", [EpisodeId(rollout, attempt)], deadline_s)
        return res

    async def aretire(
        self, rollout: str, attempt: int = 0, *, deadline_s: float | None = None
    ) -> RetireResult:
        res: RetireResult = await self._async("retire", [EpisodeId(rollout, attempt)], deadline_s)
        return res

    def retire_many(
        self, episode_ids: Iterable[EpisodeLike], *, deadline_s: float | None = None
    ) -> RetireResult:
        res: RetireResult = self._sync("retire", episodes(episode_ids), deadline_s)
        return res

    async def aretire_many(
        self, episode_ids: Iterable[EpisodeLike], *, deadline_s: float | None = None
    ) -> RetireResult:
        res: RetireResult = await self._async("retire", episodes(episode_ids), deadline_s)
        return res

    def forget(
        self, rollout_ids: Iterable[str], *, deadline_s: float | None = None
    ) -> ForgetResult:
        res: ForgetResult = self._sync("forget", list(rollout_ids), deadline_s)
        return res

    async def aforget(
        self, rollout_ids: Iterable[str], *, deadline_s: float | None = None
    ) -> ForgetResult:
        res: ForgetResult = await self._async("forget", list(rollout_ids), deadline_s)
        return res

    def timeline(self, which: str = "latest") -> dict[str, Any]:
        """The newest checkpoint ("latest") or one of the last 16 checkpoints and
        restores by ID, as a Chrome trace / Perfetto JSON object (one row per
        participant); `InvalidRequest` if the coordinator no longer keeps it."""
        res: dict[str, Any] = self._sync("timeline", which)
        return res

    async def atimeline(self, which: str = "latest") -> dict[str, Any]:
        res: dict[str, Any] = await self._async("timeline", which)
        return res
