"""The programmatic handle: attach to a cluster, get the coordinator, drive it.

```python
from coordination import connect

gym = connect(namespace="rl-run-7")              # ray.init(address="auto") if needed
result = gym.checkpoint("/ckpt/step-100", scope=continued)
gym.restore("/ckpt/step-100", episode_ids=continued)
```

Every method has an async twin (`acheckpoint`, `arestore`, ...).  Errors are
the typed `ray_ckpt.errors` ones (e.g. `CoordinationFailed` with `failures`),
not Ray wrappers: `type(err)` is the project's class and `str(err)` its
message, never a remote traceback.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from coordination.coordinator import COORDINATOR_NAME, get_or_create_coordinator
from coordination.hosts import _unwrap_ray_error
from coordination.results import (
    CheckpointResult,
    CommitResult,
    CoordinatorStatus,
    ForgetResult,
    PrepareResult,
    RestoreResult,
    ResumeResult,
    RetireResult,
)
from ray_ckpt.errors import ParticipantUnavailable
from ray_ckpt.identity import EpisodeId

EpisodeLike = EpisodeId | str | tuple[str, int]


def episodes(items: Iterable[EpisodeLike] | None) -> list[EpisodeId] | None:
    """EpisodeIds from EpisodeIds, capture keys (`r`, `r-a2`) or (rollout, attempt)."""
    if items is None:
        return None
    out: list[EpisodeId] = []
    for e in items:
        if isinstance(e, EpisodeId):
            out.append(e)
        elif isinstance(e, str):
            out.append(EpisodeId.from_capture_key(e))
        else:
            out.append(EpisodeId(e[0], e[1]))
    return out


class CoordinatorHandle:
    def __init__(self, actor: Any, namespace: str) -> None:
        self.actor = actor
        self.namespace = namespace

    def _sync(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray

        try:
            return ray.get(getattr(self.actor, method).remote(*args, **kwargs))
        except Exception as exc:
            # No `except CheckpointError: raise` first: Ray's `RayTaskError`
            # for a remote CheckpointError is also an instance of it (a
            # dual-class wrapper whose str() is the remote traceback).
            raise _unwrap_ray_error(exc, f"coordinator {method}") from None

    async def _async(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await getattr(self.actor, method).remote(*args, **kwargs)
        except Exception as exc:
            raise _unwrap_ray_error(exc, f"coordinator {method}") from None

    # --- checkpoint ------------------------------------------------------------
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
    ) -> CheckpointResult:
        """prepare → commit (scope) → Gym manifest → resume; `resume=False` keeps it
        open for publishing (call `resume()` after).  The result's `continued` and
        `restart` say which episodes of the scope have state and which start over;
        `strict=True` refuses (`RestartInScope`, nothing published) if any would
        start over."""
        res: CheckpointResult = self._sync(
            "checkpoint",
            str(checkpoint_dir),
            episodes(scope),
            resume,
            stop,
            prepare_s,
            commit_s,
            strict,
        )
        return res

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
    ) -> CheckpointResult:
        res: CheckpointResult = await self._async(
            "checkpoint",
            str(checkpoint_dir),
            episodes(scope),
            resume,
            stop,
            prepare_s,
            commit_s,
            strict,
        )
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
    ) -> CommitResult:
        res: CommitResult = self._sync(
            "commit", str(checkpoint_dir), episodes(scope), stop, strict=strict
        )
        return res

    async def acommit(
        self,
        checkpoint_dir: str,
        scope: Iterable[EpisodeLike] | None = None,
        *,
        stop: bool = False,
        strict: bool = False,
    ) -> CommitResult:
        res: CommitResult = await self._async(
            "commit", str(checkpoint_dir), episodes(scope), stop, strict=strict
        )
        return res

    def resume(self) -> ResumeResult:
        res: ResumeResult = self._sync("resume")
        return res

    async def aresume(self) -> ResumeResult:
        res: ResumeResult = await self._async("resume")
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
        episode_ids: Iterable[EpisodeLike],
        *,
        resume: bool = True,
        allow_without_gym_manifest: bool = False,
    ) -> RestoreResult:
        """`allow_without_gym_manifest`: restore a directory NeMo Gym's controller
        wrote (participant manifests only, no ``gym/_manifest.json``), after
        checking each participant's manifest is there, complete and of one ID."""
        res: RestoreResult = self._sync(
            "restore",
            str(checkpoint_dir),
            episodes(episode_ids),
            resume,
            allow_without_gym_manifest=allow_without_gym_manifest,
        )
        return res

    async def arestore(
        self,
        checkpoint_dir: str,
        episode_ids: Iterable[EpisodeLike],
        *,
        resume: bool = True,
        allow_without_gym_manifest: bool = False,
    ) -> RestoreResult:
        res: RestoreResult = await self._async(
            "restore",
            str(checkpoint_dir),
            episodes(episode_ids),
            resume,
            allow_without_gym_manifest=allow_without_gym_manifest,
        )
        return res

    def retire(self, rollout: str, attempt: int = 0) -> RetireResult:
        res: RetireResult = self._sync("retire", [EpisodeId(rollout, attempt)])
        return res

    async def aretire(self, rollout: str, attempt: int = 0) -> RetireResult:
        res: RetireResult = await self._async("retire", [EpisodeId(rollout, attempt)])
        return res

    def retire_many(self, episode_ids: Iterable[EpisodeLike]) -> RetireResult:
        res: RetireResult = self._sync("retire", episodes(episode_ids))
        return res

    async def aretire_many(self, episode_ids: Iterable[EpisodeLike]) -> RetireResult:
        res: RetireResult = await self._async("retire", episodes(episode_ids))
        return res

    def forget(self, rollout_ids: Iterable[str]) -> ForgetResult:
        res: ForgetResult = self._sync("forget", list(rollout_ids))
        return res

    async def aforget(self, rollout_ids: Iterable[str]) -> ForgetResult:
        res: ForgetResult = await self._async("forget", list(rollout_ids))
        return res

    # --- status / membership ---------------------------------------------------
    def status(self) -> CoordinatorStatus:
        res: CoordinatorStatus = self._sync("status")
        return res

    async def astatus(self) -> CoordinatorStatus:
        res: CoordinatorStatus = await self._async("status")
        return res

    def register_actor(self, kind: str, name: str, handle: Any = None) -> str:
        key: str = self._sync("register_actor", kind, name, handle)
        return key

    def register_http(self, kind: str, name: str, url: str, token: str, **pool: int) -> str:
        key: str = self._sync("register_http", kind, name, url, token, **pool)
        return key

    def discover_http(
        self, servers: list[tuple[str, str, str]], token: str, **pool: int
    ) -> dict[str, list[str]]:
        """Register the `(kind, name, url)` servers that are participants; a 404
        on status means "not a participant" (listed under "skipped")."""
        found: dict[str, list[str]] = self._sync("discover_http", servers, token, **pool)
        return found

    def register_trainer(self, handle: Any, **options: Any) -> None:
        """`options`: pause_method, resume_method, pass_args, mode ("full"|"barrier")."""
        self._sync("register_pause", "trainer", handle, **options)

    def register_assembler(self, handle: Any, **options: Any) -> None:
        self._sync("register_pause", "assembler", handle, **options)

    def discover(self) -> list[str]:
        keys: list[str] = self._sync("discover", refresh=True)
        return keys

    async def adiscover(self) -> list[str]:
        keys: list[str] = await self._async("discover", refresh=True)
        return keys

    def ping(self) -> str | None:
        """Wait until the coordinator is up (and has recovered)."""
        res: str | None = self._sync("ping")
        return res

    async def aping(self) -> str | None:
        res: str | None = await self._async("ping")
        return res


def connect(
    namespace: str = "ray-ckpt",
    address: str | None = "auto",
    *,
    create: bool = True,
    name: str = COORDINATOR_NAME,
    **coordinator_options: Any,
) -> CoordinatorHandle:
    """Attach to Ray (only if not yet initialised) and get the named coordinator.

    `address`: "auto" attaches to a running cluster, None starts a local one,
    anything else is a cluster address.  `create=False` only finds one.
    """
    import ray

    if not namespace:
        raise ValueError("connect needs an explicit namespace")
    if not ray.is_initialized():
        ray.init(
            address=address, namespace=namespace, ignore_reinit_error=True, log_to_driver=False
        )
    if create:
        actor = _live_coordinator(namespace, name, coordinator_options)
    else:
        try:
            actor = ray.get_actor(name, namespace=namespace)
        except ValueError:
            raise ParticipantUnavailable(
                f"no coordinator {name!r} in namespace {namespace!r}"
            ) from None
    return CoordinatorHandle(actor, namespace)


def _live_coordinator(namespace: str, name: str, options: dict[str, Any]) -> Any:
    """Get or create the coordinator and make sure it answers.

    A coordinator that is not detached dies with the driver that created it
    (e.g. an earlier `ray-ckpt` command); for a moment after, `get_if_exists`
    can still hand out the dying actor.  Retry until a live one answers.
    """
    import ray
    from ray.exceptions import RayActorError

    for _ in range(_CONNECT_TRIES - 1):
        actor = get_or_create_coordinator(namespace, name=name, **options)
        try:
            ray.get(actor.ping.remote(), timeout=60)
            return actor
        except RayActorError:
            time.sleep(0.25)
    return get_or_create_coordinator(namespace, name=name, **options)


_CONNECT_TRIES = 40
