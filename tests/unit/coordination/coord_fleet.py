"""A fleet of in-process participants for coordinator unit tests (no Ray)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from coordination.engine.coordinator_core import CoordinatorCore
from coordination.engine.journal import Journal
from coordination.engine.order import Member
from coordination.engine.results import Timeouts
from coordination.reach.hosts import FakeHost, Log
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.settings import CheckpointSettings
from tests.unit.fakes import FakeParticipant, MemoryStore

SETTINGS = CheckpointSettings.model_validate(
    {"enabled": True, "control_auth_token": "t", "lease_grace_seconds": 600}
)
FAST = Timeouts(
    prepare_s=0.3,
    commit_s=2.0,
    resume_s=2.0,
    restore_s=2.0,
    retire_s=2.0,
    status_s=1.0,
    pause_s=1.0,
    renew_every_s=3600.0,
    reply_grace_s=0.3,
    cleanup_min_s=2.0,
)
DEFAULT_MEMBERS = ("environment/env", "model/policy", "agent/agent", "resources/res")


@dataclass
class Fleet:
    core: CoordinatorCore
    hosts: dict[str, FakeHost]
    parts: dict[str, FakeParticipant]
    ctrls: dict[str, ParticipantEngine]
    store: MemoryStore
    log: Log
    manifests: list[tuple[str, str, list[dict[str, Any]]]] = field(default_factory=list)
    latests: list[tuple[str, str]] = field(default_factory=list)

    def phases(self) -> dict[str, str]:
        return {k: c.state.phase.value for k, c in self.ctrls.items()}

    def events(self, op: str, event: str = "call") -> list[str]:
        return [who for _, ev, who, o in self.log if o == op and ev == event]

    def add(self, key: str, *, register: bool = True) -> FakeHost:
        """One more in-process participant over the same store and log."""
        m = Member.parse(key)
        part = FakeParticipant(m.kind)
        ctrl = ParticipantEngine(part, instance=m.name, settings=SETTINGS, store=self.store)
        host = FakeHost(m, ctrl, log=self.log)
        self.hosts[key], self.parts[key], self.ctrls[key] = host, part, ctrl
        if register:
            self.core.register(host)
        return host

    async def aclose(self) -> None:
        for c in self.ctrls.values():
            await c.aclose()
        await self.core.aclose()


def make_fleet(
    members: tuple[str, ...] = DEFAULT_MEMBERS,
    *,
    store: MemoryStore | None = None,
    timeouts: Timeouts = FAST,
    state_dir: str | None = None,
    listed: set[tuple[str, str]] | None = None,
    log: Log | None = None,
) -> Fleet:
    store = store or MemoryStore()
    log = log if log is not None else []
    manifests: list[tuple[str, str, list[dict[str, Any]]]] = []

    def writer(d: str, cid: str, ms: list[dict[str, Any]]) -> None:
        manifests.append((d, cid, ms))

    latests: list[tuple[str, str]] = []

    def latest(d: str, cid: str) -> None:
        latests.append((d, cid))

    def reader(d: str) -> tuple[str | None, set[tuple[str, str]]]:
        if listed is not None:
            return "ckpt-src", listed
        found = {(k, i) for (dd, k, i) in store.data if dd == d}
        return "ckpt-src", found

    core = CoordinatorCore(
        journal=Journal(state_dir),
        timeouts=timeouts,
        manifest_writer=writer,
        latest_writer=latest,
        manifest_reader=reader,
    )
    fleet = Fleet(core, {}, {}, {}, store, log)
    fleet.manifests = manifests
    fleet.latests = latests
    for key in members:
        fleet.add(key)
    return fleet
