"""Random control-call sequences against a small reference model (Hypothesis)."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ray_ckpt import ManualClock
from ray_ckpt.control.engine import ParticipantEngine
from ray_ckpt.errors import CheckpointError
from ray_ckpt.settings import CheckpointSettings
from tests.unit.fakes import FakeParticipant, MemoryStore

IDS = st.sampled_from(["a", "b", "c", "d"])
GRACE = 50.0


class Model:
    """What a participant whose work is always at a boundary must answer."""

    def __init__(self) -> None:
        self.phase = "idle"
        self.active: str | None = None
        self.resumed: set[str] = set()

    def fence(self, cid: str, *, unfenced_when_closed: bool = False) -> str | None:
        # Retire and forget outside an open checkpoint are not fenced by
        # resumed IDs (NeMo Gym's straggler path: resume, then retire).
        if cid in self.resumed and not (unfenced_when_closed and self.active is None):
            return "stale_checkpoint"
        if self.active is not None and self.active != cid:
            return "checkpoint_conflict"
        return None

    def prepare(self, cid: str) -> str:
        if err := self.fence(cid):
            return err
        if self.phase == "committed":
            return "ok"  # the cached prepared reply of this same checkpoint
        if self.phase not in ("idle", "preparing", "prepared"):
            return "invalid_phase"
        self.phase, self.active = "prepared", cid
        return "ok"

    def commit(self, cid: str) -> str:
        if err := self.fence(cid):
            return err
        if self.phase in ("prepared", "committed"):
            self.phase = "committed"
            return "ok"
        return "invalid_phase"

    def renew(self, cid: str) -> str:
        if err := self.fence(cid):
            return err
        return "invalid_phase" if self.phase == "idle" else "ok"

    def retire(self, cid: str) -> str:
        if err := self.fence(cid, unfenced_when_closed=True):
            return err
        return "ok" if self.phase in ("idle", "restored") else "invalid_phase"

    forget = retire  # the same fence and phases

    def resume(self, cid: str) -> str:
        """`ok idempotent` when nothing was open for `cid` (resumed before,
        or never seen while idle), `ok` when it ended an open checkpoint."""
        if cid in self.resumed:
            return "ok idempotent"
        if self.active is not None and self.active != cid:
            return "checkpoint_conflict"
        self.resumed.add(cid)
        ended = self.active is not None
        self.phase, self.active = "idle", None
        return "ok" if ended else "ok idempotent"

    def expire(self) -> None:
        if self.active is not None:
            self.resumed.add(self.active)
        self.phase, self.active = "idle", None


class ControlMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock(1000.0)
        self.participant = FakeParticipant()
        self.participant.start("r1", at_boundary=True)
        cfg = CheckpointSettings(enabled=True, control_auth_token="t", lease_grace_seconds=GRACE)
        self.ctl = ParticipantEngine(
            self.participant, instance="i", settings=cfg, clock=self.clock, store=MemoryStore()
        )
        self.model = Model()

    def call(self, op: str, cid: str, ahead: float = 10.0, **extra: Any) -> str:
        body = {"checkpoint_id": cid, "deadline_ts": self.clock.now() + ahead, **extra}
        try:
            reply = self.loop.run_until_complete(self.ctl.handle(op, body))
        except CheckpointError as exc:
            return exc.code
        return "ok idempotent" if reply.get("idempotent") else "ok"

    @rule(cid=IDS)
    def prepare(self, cid: str) -> None:
        assert self.call("prepare", cid) == self.model.prepare(cid)

    @rule(cid=IDS)
    def prepare_past_its_deadline(self, cid: str) -> None:
        # The deadline bounds only the wait: always-ready work is prepared.
        assert self.call("prepare", cid, ahead=-1.0) == self.model.prepare(cid)

    @rule(cid=IDS)
    def commit(self, cid: str) -> None:
        assert self.call("commit", cid, checkpoint_dir="/d") == self.model.commit(cid)

    @rule(cid=IDS)
    def renew(self, cid: str) -> None:
        assert self.call("renew", cid) == self.model.renew(cid)

    @rule(cid=IDS)
    def resume(self, cid: str) -> None:
        assert self.call("resume", cid) == self.model.resume(cid)

    @rule(cid=IDS)
    def retire(self, cid: str) -> None:
        got = self.call("retire", cid, episode_ids=[{"rollout_id": "gone"}])
        assert got == self.model.retire(cid)

    @rule(cid=IDS)
    def forget(self, cid: str) -> None:
        assert self.call("forget", cid, rollout_ids=["gone"]) == self.model.forget(cid)

    @rule()
    def lease_lapses(self) -> None:
        self.clock.advance(GRACE + 20)
        self.loop.run_until_complete(self.ctl.check_lease())
        self.model.expire()

    @invariant()
    def phase_and_admission_agree(self) -> None:
        status = self.ctl.status()
        assert status["phase"] == self.model.phase
        assert status["checkpoint_id"] == self.model.active
        assert self.participant.admission_open == (self.model.phase == "idle")

    def teardown(self) -> None:
        self.loop.close()


ControlMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestControlModel = ControlMachine.TestCase
