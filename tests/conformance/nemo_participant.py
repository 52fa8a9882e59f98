"""A NeMo Gym-shaped participant: its control plane as the reference notes describe it.

Written from the facts in `gym-protocol-notes.md` §1.1-1.18 only (NeMo Gym's
code is not available to us and is never copied).  It is the other side of
our wire contract in the conformance suite: our coordinator must drive it.

What it reproduces, on purpose, where NeMo Gym differs from us (§1.18):
- bodies are pydantic models with `extra="forbid"`, validated *before* the
  bearer check, and a validation error is FastAPI's 422 `{"detail": [...]}`;
- `report.blockers` is a list of capture-key strings (capped at 100) with
  `blocker_count` the full count;
- the participant manifest is `{schema_version, kind, instance,
  checkpoint_id, records_file: records-<sha>.jsonl, records_sha256,
  record_count}`, records are stdlib-JSON lines, the manifest is written last
  and created once (hard link); there is no Gym manifest;
- retire/forget are not fenced by remembered IDs outside an open checkpoint;
- a prepare past its deadline answers `prepared` when ready (the deadline
  bounds only the wait), `preparing` with blockers otherwise;
- resume of a never-seen ID while idle answers `idempotent: true`;
- a commit retried after `committed` is answered from the reply cache.

The "episodes" are deliberately simple: capture key → a JSON state, which a
test starts, blocks (a straggler) or marks as a restart, and which restore
installs under attempt+1.  The kind is one of environment/model/agent/resources.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import json
import math
import os
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from aiohttp import web
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

PREFIX = "/ng-control/v1/checkpoint"
KINDS = ("environment", "model", "agent", "resources")
MAX_REPORTED_BLOCKERS = 100
RESUMED_IDS_KEPT = 64
NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_RESERVED_SUFFIX = re.compile(r"-a([1-9][0-9]*)$")
_SEQ = itertools.count()  # one order over every participant in the process: call order
_RECORDS_FILE = re.compile(r"^records-[0-9a-f]{64}\.jsonl$|^records\.jsonl$")


# --- identity (§1.13) ----------------------------------------------------------


def _rollout_id(value: str) -> str:
    if _RESERVED_SUFFIX.search(value):
        raise ValueError("a rollout_id may not end in -a<N>")
    return value


class EpisodeId(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    rollout_id: Annotated[str, Field(min_length=1, pattern=NAME), AfterValidator(_rollout_id)]
    attempt: int = Field(default=0, ge=0)

    @property
    def capture_key(self) -> str:
        return self.rollout_id if self.attempt == 0 else f"{self.rollout_id}-a{self.attempt}"

    @classmethod
    def from_capture_key(cls, key: str) -> EpisodeId:
        m = _RESERVED_SUFFIX.search(key)
        if m is None:
            return cls(rollout_id=key)
        return cls(rollout_id=key[: m.start()], attempt=int(m.group(1)))

    def next(self) -> EpisodeId:
        return EpisodeId(rollout_id=self.rollout_id, attempt=self.attempt + 1)

    def wire(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "attempt": self.attempt}


# --- request bodies (§1.2) -----------------------------------------------------


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("deadline_ts must be finite")
    return value


class CheckpointRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checkpoint_id: str = Field(min_length=1, max_length=128, pattern=NAME)
    deadline_ts: Annotated[float, AfterValidator(_finite)]


class CommitRequest(CheckpointRequest):
    checkpoint_dir: str
    episode_ids: list[EpisodeId] | None = None
    stop: bool = False


class RestoreRequest(CheckpointRequest):
    checkpoint_dir: str
    episode_ids: list[EpisodeId]


class RetireRequest(CheckpointRequest):
    episode_ids: list[EpisodeId] = Field(min_length=1)


class ForgetRequest(CheckpointRequest):
    rollout_ids: list[str] = Field(min_length=1)


REQUESTS: dict[str, type[CheckpointRequest]] = {
    "prepare": CheckpointRequest,
    "renew": CheckpointRequest,
    "resume": CheckpointRequest,
    "commit": CommitRequest,
    "restore": RestoreRequest,
    "retire": RetireRequest,
    "forget": ForgetRequest,
}


# --- errors (§1.4) -------------------------------------------------------------


class ControlError(Exception):
    def __init__(self, code: str, status: int, detail: str) -> None:
        super().__init__(detail)
        self.code, self.status, self.detail = code, status, detail


def stale(detail: str) -> ControlError:
    return ControlError("stale_checkpoint", 409, detail)


def conflict(detail: str) -> ControlError:
    return ControlError("checkpoint_conflict", 409, detail)


def invalid_phase(detail: str) -> ControlError:
    return ControlError("invalid_phase", 409, detail)


def bad_state(detail: str) -> ControlError:
    return ControlError("invalid_checkpoint_state", 422, detail)


# --- episodes ------------------------------------------------------------------


@dataclass
class Episode:
    episode_id: EpisodeId
    state: dict[str, Any]
    blocking: bool = False  # a step that must finish before a checkpoint (a straggler)
    restart: bool = False  # uses a server that cannot capture its part: never exported
    restored: bool = False  # installed by restore, not yet claimed


@dataclass
class NemoParticipant:
    """One participant's control plane and its episodes (one event loop)."""

    kind: str
    instance: str
    token: str
    lease_grace_seconds: float = 600.0
    phase: str = "idle"
    active_id: str | None = None
    admission_open: bool = True
    lease_expires_at: float | None = None
    episodes: dict[str, Episode] = field(default_factory=dict)
    marks: dict[str, int] = field(default_factory=dict)
    served: bool = False
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)  # `_SEQ` number of each call
    _resumed: OrderedDict[str, None] = field(default_factory=OrderedDict)
    _cache: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _watcher: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r}")
        if not re.match(NAME, self.instance) or not self.token:
            raise ValueError("bad instance name or empty token")

    # --- the test's side: the data plane, reduced to what a checkpoint sees ---
    def start(
        self,
        rollout_id: str,
        attempt: int = 0,
        *,
        state: dict[str, Any] | None = None,
        blocking: bool = False,
        restart: bool = False,
    ) -> Episode:
        """Serve an episode (as a `/run` would); refused as NeMo Gym's data planes refuse."""
        eid = EpisodeId(rollout_id=rollout_id, attempt=attempt)
        if attempt <= self.marks.get(rollout_id, -1):
            raise ControlError("stale_attempt", 409, f"{eid.capture_key} is retired")
        if not self.admission_open:
            raise ControlError("admission_closed", 409, "a checkpoint is open")
        restored = self.episodes.get(eid.capture_key)
        if restored is not None and restored.restored:
            restored.restored = False  # the replacement attempt claims its restored state
            return restored
        ep = Episode(eid, state or {"step": 0}, blocking=blocking, restart=restart)
        self.episodes[eid.capture_key] = ep
        self.served = True
        return ep

    async def unblock(self, key: str) -> None:
        self.episodes[key].blocking = False
        await self.notify()

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # --- readiness (§1.3, §1.7, §1.14) -------------------------------------
    def _blockers(self) -> list[str]:
        return sorted(k for k, e in self.episodes.items() if e.blocking and not e.restart)

    def ready(self) -> bool:
        return not self._blockers()

    def report(self) -> dict[str, Any]:
        blockers = self._blockers()
        return {
            "ready": not blockers,
            "blockers": blockers[:MAX_REPORTED_BLOCKERS],
            "blocker_count": len(blockers),
            "counts": {"episodes": len(self.episodes), "blocking": len(blockers)},
            "restarts": sorted(k for k, e in self.episodes.items() if e.restart),
        }

    def status(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "instance": self.instance,
            "phase": self.phase,
            "checkpoint_id": self.active_id,
            "lease_expires_at": self.lease_expires_at,
            "retired_rollouts": len(self.marks),
            "report": self.report(),
        }

    # --- fencing (§1.5) and lease (§1.6) -------------------------------------
    def _admit(self, cid: str, allowed: set[str]) -> None:
        if cid in self._resumed:
            raise stale(f"checkpoint {cid} was already resumed")
        if self.active_id is not None and self.active_id != cid:
            raise conflict(f"checkpoint {self.active_id} is active")
        if self.phase not in allowed:
            raise invalid_phase(f"{cid}: not valid in phase {self.phase}")

    def _renew(self, req: CheckpointRequest) -> None:
        until = req.deadline_ts + self.lease_grace_seconds
        self.lease_expires_at = max(self.lease_expires_at or until, until)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch_lease())

    async def _watch_lease(self) -> None:
        while self.active_id is not None and self.lease_expires_at is not None:
            wait = self.lease_expires_at - time.time()
            if wait > 0:
                await asyncio.sleep(min(wait, 1.0))
                continue
            async with self._lock:
                cid = self.active_id
                expires = self.lease_expires_at
                if cid is not None and expires is not None and time.time() >= expires:
                    self._reopen(cid)  # expiry is exactly an abort
            return

    def _remember(self, cid: str) -> None:
        self._resumed[cid] = None
        self._resumed.move_to_end(cid)
        while len(self._resumed) > RESUMED_IDS_KEPT:
            self._resumed.popitem(last=False)

    def _reopen(self, cid: str) -> None:
        self.phase, self.active_id, self.admission_open = "idle", None, True
        self.lease_expires_at = None
        self._remember(cid)
        for key in [k for k in self._cache if k[0] == cid]:
            del self._cache[key]

    # --- operations ------------------------------------------------------------
    async def handle(self, op: str, req: CheckpointRequest) -> dict[str, Any]:
        self.calls.append((op, req.model_dump(mode="json")))
        self.seq.append(next(_SEQ))
        handler = getattr(self, f"_op_{op}")
        reply: dict[str, Any] = await handler(req)
        return reply

    async def _op_prepare(self, req: CheckpointRequest) -> dict[str, Any]:
        cid = req.checkpoint_id
        async with self._lock:
            if cid not in self._resumed and (cid, "prepare") in self._cache:
                return self._cache[(cid, "prepare")]
            self._admit(cid, {"idle", "preparing"})
            self.phase, self.active_id, self.admission_open = "preparing", cid, False
            self._renew(req)
        # The wait is outside the lock so a resume can interrupt it; the
        # deadline bounds only the wait, never a participant already ready.
        async with self._changed:
            while self.active_id == cid and not self.ready():
                remaining = req.deadline_ts - time.time()
                if remaining <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))
        async with self._lock:
            if self.active_id != cid:
                return {"phase": "idle", "report": self.report()}
            if not self.ready():
                return {"phase": "preparing", "report": self.report()}  # admission stays closed
            self.phase = "prepared"
            reply = {"phase": "prepared", "report": self.report()}
            self._cache[(cid, "prepare")] = reply
            return reply

    async def _op_renew(self, req: CheckpointRequest) -> dict[str, Any]:
        async with self._lock:
            self._admit(req.checkpoint_id, {"preparing", "prepared", "committed", "restored"})
            self._renew(req)
            return {"lease_expires_at": self.lease_expires_at}

    async def _op_commit(self, req: CheckpointRequest) -> dict[str, Any]:
        assert isinstance(req, CommitRequest)
        cid = req.checkpoint_id
        async with self._lock:
            if cid not in self._resumed and (cid, "commit") in self._cache:
                return self._cache[(cid, "commit")]  # a retry, whatever its directory
            self._admit(cid, {"prepared"})
            self._renew(req)
            if not self.ready():
                raise invalid_phase(f"{cid}: participant is no longer ready")
            scope = None if req.episode_ids is None else {e.capture_key for e in req.episode_ids}
            restarts = {k for k, e in self.episodes.items() if e.restart}
            if scope is not None and scope & restarts:
                raise ControlError(
                    "restart_in_scope", 409, f"scope names restarts {sorted(scope & restarts)}"
                )
            chosen = sorted(
                k
                for k, e in self.episodes.items()
                if not e.restart and (scope is None or k in scope)
            )
            records = [
                {"episode_id": self.episodes[k].episode_id.wire(), "state": self.episodes[k].state}
                for k in chosen
            ]
            manifest = await asyncio.to_thread(self._write, req.checkpoint_dir, cid, records)
            if scope is not None:  # restored-but-unclaimed state outside the scope is deleted
                for key in [k for k, e in self.episodes.items() if e.restored and k not in scope]:
                    del self.episodes[key]
            self.phase = "committed"
            reply = {"phase": "committed", "manifest": manifest, "episode_ids": chosen}
            self._cache[(cid, "commit")] = reply
            return reply

    def _where(self, checkpoint_dir: str) -> Path:
        return Path(checkpoint_dir) / "gym" / self.kind / self.instance

    def _write(
        self, checkpoint_dir: str, cid: str, records: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """Records first (temp, fsync, rename to its digest), the manifest last, created once."""
        where = self._where(checkpoint_dir)
        where.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        tmp = where / f".records.jsonl.{uuid.uuid4().hex}"
        with tmp.open("wb") as f:
            for record in records:
                line = (json.dumps(record) + "\n").encode()  # stdlib: key order, NaN kept
                digest.update(line)
                f.write(line)
            f.flush()
            os.fsync(f.fileno())
        name = f"records-{digest.hexdigest()}.jsonl"
        os.replace(tmp, where / name)
        manifest = {
            "schema_version": 1,
            "kind": self.kind,
            "instance": self.instance,
            "checkpoint_id": cid,
            "records_file": name,
            "records_sha256": digest.hexdigest(),
            "record_count": len(records),
        }
        text = json.dumps(manifest, sort_keys=True, indent=1)
        mtmp = where / f".manifest.json.{uuid.uuid4().hex}"
        mtmp.write_text(text)
        try:
            os.link(mtmp, where / "manifest.json")  # created, never replaced
        except FileExistsError:
            existing = json.loads((where / "manifest.json").read_text())
            if existing != manifest:
                raise bad_state(f"{where}/manifest.json holds another commit") from None
        finally:
            mtmp.unlink()
        dfd = os.open(where, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return manifest

    def _read(self, checkpoint_dir: str, scope: set[str]) -> tuple[str, list[dict[str, Any]]]:
        where = self._where(checkpoint_dir)
        try:
            manifest = json.loads((where / "manifest.json").read_text())
        except (OSError, ValueError) as exc:
            raise bad_state(f"manifest of {where}: {exc}") from None
        if (
            manifest.get("schema_version") != 1
            or manifest.get("kind") != self.kind
            or manifest.get("instance") != self.instance
            or not isinstance(manifest.get("checkpoint_id"), str)
            or not _RECORDS_FILE.match(str(manifest.get("records_file")))
        ):
            raise bad_state(f"manifest of {where} is not this participant's")
        digest, count, kept = hashlib.sha256(), 0, []
        try:
            with (where / manifest["records_file"]).open("rb") as f:
                for line in f:  # one pass; digest and count over the whole file
                    digest.update(line)
                    count += 1
                    record = json.loads(line)
                    if EpisodeId(**record["episode_id"]).capture_key in scope:
                        kept.append(record)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise bad_state(f"records of {where}: {exc}") from None
        if digest.hexdigest() != manifest.get("records_sha256") or count != manifest.get(
            "record_count"
        ):
            raise bad_state(f"records of {where}: digest or count mismatch")
        return str(manifest["checkpoint_id"]), kept

    async def _op_restore(self, req: CheckpointRequest) -> dict[str, Any]:
        assert isinstance(req, RestoreRequest)
        cid = req.checkpoint_id
        async with self._lock:
            if cid not in self._resumed and (cid, "restore") in self._cache:
                return self._cache[(cid, "restore")]
            self._admit(cid, {"idle"})
            if self.served or self.episodes:
                raise invalid_phase(f"{self.kind} restore requires a freshly started server")
            scope = {e.capture_key for e in req.episode_ids}
            source, records = await asyncio.to_thread(self._read, req.checkpoint_dir, scope)
            self.admission_open = False
            # Everything read and valid: only now install, each under attempt+1.
            for record in records:
                nxt = EpisodeId(**record["episode_id"]).next()
                self.episodes[nxt.capture_key] = Episode(nxt, record["state"], restored=True)
            self.phase, self.active_id = "restored", cid
            self._renew(req)
            restored = sorted(EpisodeId(**r["episode_id"]).next().capture_key for r in records)
            reply = {"phase": "restored", "source_checkpoint_id": source, "restored": restored}
            self._cache[(cid, "restore")] = reply
            return reply

    async def _op_resume(self, req: CheckpointRequest) -> dict[str, Any]:
        cid = req.checkpoint_id
        async with self._lock:
            if cid in self._resumed:
                return {"phase": "idle", "idempotent": True}
            if self.active_id is None:
                # The prepare never reached us: remember the ID so a delayed one is refused.
                self._remember(cid)
                return {"phase": "idle", "idempotent": True}
            if self.active_id != cid:
                raise conflict(f"checkpoint {self.active_id} is active")
            self._reopen(cid)
        await self.notify()
        return {"phase": "idle", "idempotent": False}

    def _retire_fence(self, req: CheckpointRequest) -> None:
        """Idle: no fencing by remembered IDs.  Restored: the ID must match.  Else refused."""
        if self.phase == "restored":
            if req.checkpoint_id != self.active_id:
                raise conflict(f"checkpoint {self.active_id} is active")
            self._renew(req)
        elif self.phase != "idle":
            raise invalid_phase("a checkpoint is open: resume first")

    async def _op_retire(self, req: CheckpointRequest) -> dict[str, Any]:
        assert isinstance(req, RetireRequest)
        async with self._lock:
            self._retire_fence(req)
            for e in req.episode_ids:  # marks only rise, and are raised before anything stops
                self.marks[e.rollout_id] = max(self.marks.get(e.rollout_id, -1), e.attempt)
            for key, ep in list(self.episodes.items()):
                mark = self.marks.get(ep.episode_id.rollout_id, -1)
                if ep.episode_id.attempt <= mark:
                    del self.episodes[key]
        await self.notify()
        return {"retired": sorted(e.capture_key for e in req.episode_ids)}

    async def _op_forget(self, req: CheckpointRequest) -> dict[str, Any]:
        assert isinstance(req, ForgetRequest)
        async with self._lock:
            self._retire_fence(req)
            for rid in req.rollout_ids:
                self.marks.pop(rid, None)
        return {"forgotten": sorted(set(req.rollout_ids))}

    async def aclose(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()


# --- HTTP (§1.1) ---------------------------------------------------------------


def _json(status: int, body: Any) -> web.Response:
    return web.json_response(body, status=status)


def _error(err: ControlError) -> web.Response:
    return _json(err.status, {"error": {"code": err.code, "detail": err.detail}})


def _authorized(p: NemoParticipant, request: web.Request) -> bool:
    got = request.headers.get("Authorization", "")
    return hmac.compare_digest(got.encode(), f"Bearer {p.token}".encode())


def _unauthorized() -> web.Response:
    return _error(ControlError("unauthorized", 401, "bad or missing bearer token"))


def _fastapi_422(exc: ValidationError) -> web.Response:
    detail = [
        {"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"], "input": e.get("input")}
        for e in exc.errors(include_url=False)
    ]
    return web.json_response(
        {"detail": detail}, status=422, dumps=lambda v: json.dumps(v, default=str)
    )


def make_app(p: NemoParticipant) -> web.Application:
    async def status(request: web.Request) -> web.Response:
        if not _authorized(p, request):
            return _unauthorized()
        return _json(200, p.status())

    def operation(op: str) -> Any:
        model = REQUESTS[op]

        async def route(request: web.Request) -> web.Response:
            raw = await request.read()
            try:
                # The body before the token, as FastAPI resolves it.
                req = model.model_validate_json(raw)
            except ValidationError as exc:
                return _fastapi_422(exc)
            if not _authorized(p, request):
                return _unauthorized()
            try:
                return _json(200, await p.handle(op, req))
            except ControlError as err:
                return _error(err)

        return route

    app = web.Application()
    app.router.add_get(f"{PREFIX}/status", status)
    for op in REQUESTS:
        app.router.add_post(f"{PREFIX}/{op}", operation(op))

    async def close(_: web.Application) -> None:
        await p.aclose()

    app.on_cleanup.append(close)
    return app
