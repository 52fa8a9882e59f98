"""Who of a server's workers reported what, and what that blocks (pure).

The host closes and reopens admission on every worker; each close or open
raises the generation, and a worker's report counts only for the generation
it names: a report from before the latest close (stale: sent before the
worker saw it) is discarded, so "ready" always means "ready with admission
closed".  The table fails closed:

- a worker expected but without a report for the current generation blocks
  as ``workers-unreported:N``;
- a worker lost while admission is closed blocks as ``worker-lost:<id>``
  until admission reopens, even if a replacement joins meanwhile: the
  episodes it held are gone, so that checkpoint cannot be complete;
- a worker silent for longer than `silence_s` (no report, no heartbeat) is
  lost, so a hung worker is caught as well as a dead one.

Time comes from an injected clock; the I/O lives in `pool`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_ckpt.clock import Clock

UNREPORTED = "workers-unreported"
LOST = "worker-lost"


def worker_id(index: int) -> str:
    return f"w{index}"


@dataclass(frozen=True)
class WorkerReport:
    """What a worker says about itself at one generation."""

    generation: int
    ready: bool
    live: int = 0
    fresh: bool = True
    retiring: int = 0
    blockers: tuple[dict[str, object], ...] = ()  # Blocker objects, as plain data
    blocker_count: int = 0
    restarts: tuple[str, ...] = ()
    held: int = -1  # finished results held (completion receipts); -1: receipts off
    held_bytes: int = 0


@dataclass
class _Worker:
    incarnation: int
    pid: int
    last_seen: float
    report: WorkerReport | None = None


@dataclass
class WorkerTable:
    expected: int
    clock: Clock
    silence_s: float = 10.0
    generation: int = 0
    closed: bool = False
    _workers: dict[str, _Worker] = field(default_factory=dict)
    _lost: dict[str, int] = field(default_factory=dict)  # sticky while closed: id -> incarnation
    _incarnations: int = 0

    def __post_init__(self) -> None:
        if self.expected < 1:
            raise ValueError(f"expected workers must be >= 1, got {self.expected}")

    # --- membership ----------------------------------------------------------
    def join(self, wid: str, pid: int) -> int:
        """A worker (re)connected; returns its incarnation number.

        It has no report yet: it counts as unreported until it reports at
        the current generation (it starts closed if admission is closed)."""
        self._incarnations += 1
        old = self._workers.get(wid)
        if old is not None and self.closed:
            # Replaced without our noticing the loss: the old one's episodes are gone.
            self._lost[wid] = old.incarnation
        self._workers[wid] = _Worker(self._incarnations, pid, self.clock.now())
        return self._incarnations

    def lose(self, wid: str, incarnation: int | None = None) -> bool:
        """The worker's process or connection is gone; False if already replaced."""
        current = self._workers.get(wid)
        if current is None or (incarnation is not None and current.incarnation != incarnation):
            return False
        del self._workers[wid]
        if self.closed:
            self._lost[wid] = current.incarnation
        return True

    def expire(self) -> list[str]:
        """Lose every worker silent for longer than `silence_s`; their IDs."""
        now = self.clock.now()
        silent = [w for w, s in self._workers.items() if now - s.last_seen > self.silence_s]
        for wid in silent:
            self.lose(wid)
        return silent

    # --- generations -----------------------------------------------------------
    def close(self) -> int:
        self.generation += 1
        self.closed = True
        return self.generation

    def open(self) -> int:
        self.generation += 1
        self.closed = False
        self._lost.clear()  # the checkpoint that saw the loss is over
        return self.generation

    def report(self, wid: str, incarnation: int, report: WorkerReport) -> bool:
        """Record a report; False (discarded) if stale or from a replaced worker."""
        current = self._workers.get(wid)
        if current is None or current.incarnation != incarnation:
            return False
        current.last_seen = self.clock.now()
        if report.generation != self.generation:
            return False
        current.report = report
        return True

    def heartbeat(self, wid: str, incarnation: int) -> None:
        current = self._workers.get(wid)
        if current is not None and current.incarnation == incarnation:
            current.last_seen = self.clock.now()

    # --- what it means -----------------------------------------------------------
    def current(self) -> dict[str, WorkerReport]:
        """The reports that count: this generation's, by worker ID."""
        return {
            w: s.report
            for w, s in self._workers.items()
            if s.report is not None and s.report.generation == self.generation
        }

    def latest(self) -> dict[str, WorkerReport]:
        """Each connected worker's last report, whatever its generation: what it
        holds right after a close or open, until it reports at the new one."""
        return {w: s.report for w, s in self._workers.items() if s.report is not None}

    def unreported(self) -> int:
        lost_here = sum(1 for w in self._lost if w not in self._workers)
        return max(self.expected - len(self.current()) - lost_here, 0)

    def blockers(self) -> list[str]:
        """Worker blockers, lost ones first (named), then the unreported count."""
        keys = [f"{LOST}:{w}" for w in sorted(self._lost)]
        missing = self.unreported()
        if missing:
            keys.append(f"{UNREPORTED}:{missing}")
        return keys

    def ready(self) -> bool:
        reports = self.current()
        return (
            self.closed
            and not self.blockers()
            and len(reports) >= self.expected
            and all(r.ready for r in reports.values())
        )

    def live(self) -> int:
        return sum(s.report.live for s in self._workers.values() if s.report is not None)

    def fresh(self) -> bool:
        """Every expected worker is here, reported, and has served nothing."""
        reports = self.current()
        return (
            not self._lost
            and len(reports) >= self.expected
            and all(r.fresh for r in reports.values())
        )

    def members(self) -> dict[str, tuple[int, int]]:
        """Connected workers: ID -> (incarnation, pid)."""
        return {w: (s.incarnation, s.pid) for w, s in self._workers.items()}

    def summary(self) -> dict[str, object]:
        return {
            "expected": self.expected,
            "connected": len(self._workers),
            "generation": self.generation,
            "closed": self.closed,
            "reported": sorted(self.current()),
            "lost": sorted(self._lost),
            "blockers": self.blockers(),
        }
