"""What a signal checkpoint may take and what it reports: pure, no handlers.

The signals that stop the process after their checkpoint and those that let
it go on, how a grace budget is cut into phase deadlines (`cut_budget`), and
the `SignalCheckpoint` a signal leaves behind.  `coordination.triggers.signals` does
the handling; the drain watcher (`coordination.triggers.drain`) cuts its deadline
budget the same way.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from ray_ckpt.errors import DeadlineExceeded, InvalidRequest

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
CONTINUE_SIGNALS = frozenset({signal.SIGUSR1, signal.SIGUSR2})
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
DEFAULT_GRACE_S = 25.0  # inside Kubernetes' default 30 s grace period
# Of what is left of the budget: the prepare's share (reaching boundaries is
# quick; writing records is the long part), and what is kept back for the
# Gym manifest, `LATEST` and the exit.
PREPARE_SHARE = 0.35
RESERVE_SHARE = 0.1
RESERVE_MAX_S = 2.0


class SignalCheckpoint(msgspec.Struct, frozen=True, kw_only=True):
    """One signal-triggered checkpoint, complete or failed."""

    trigger: str  # "SIGTERM", "SIGUSR1", ...
    stop: bool
    location: str
    ok: bool
    checkpoint_id: str | None = None
    episodes: int = 0  # in its scope
    seconds: float = 0.0  # from the signal to the end
    grace_s: float = 0.0
    prepare_s: float = 0.0  # the phase deadlines the budget gave
    commit_s: float = 0.0
    joined: list[str] = msgspec.field(default_factory=list)  # signals that joined it
    error: dict[str, Any] | None = None


@dataclass(frozen=True)
class Budget:
    prepare_s: float
    commit_s: float
    wait_s: float  # how long the driver waits for the whole checkpoint
    # The coordinator's overall deadline (`checkpoint(total_s=...)`): past it
    # the checkpoint is not published; half the reserve is left after it for
    # the Gym manifest and `LATEST`.
    total_s: float = 0.0


def cut_budget(grace_s: float, elapsed_s: float) -> Budget:
    """Phase deadlines that fit what is left of `grace_s` after `elapsed_s`;
    `DeadlineExceeded` if nothing is left."""
    left = grace_s - elapsed_s
    reserve = min(RESERVE_MAX_S, grace_s * RESERVE_SHARE)
    phases = left - reserve
    if phases <= 0:
        raise DeadlineExceeded(f"the grace budget of {grace_s:g}s is spent")
    prepare = phases * PREPARE_SHARE
    return Budget(
        prepare_s=prepare, commit_s=phases - prepare, wait_s=left, total_s=left - reserve / 2
    )


def check_signals(signals: Iterable[int]) -> tuple[signal.Signals, ...]:
    out: list[signal.Signals] = []
    for s in signals:
        try:
            sig = signal.Signals(s)
        except (ValueError, TypeError):
            raise InvalidRequest(f"not a signal: {s!r}") from None
        if sig not in STOP_SIGNALS | CONTINUE_SIGNALS:
            names = sorted(x.name for x in STOP_SIGNALS | CONTINUE_SIGNALS)
            raise InvalidRequest(f"cannot checkpoint on {sig.name}: one of {names}")
        if sig not in out:
            out.append(sig)
    if not out:
        raise InvalidRequest("no signals to checkpoint on")
    return tuple(out)
