"""Checkpoint on a signal: SIGUSR1 checkpoints and goes on, SIGTERM checkpoints and exits.

Preemptions announce themselves: Slurm (`--signal=B:TERM@120`), Kubernetes
(`terminationGracePeriodSeconds`) and `ray job stop` send SIGTERM some time
before the SIGKILL.  `SignalCheckpointing.install()` (explicit: importing
installs nothing) makes the driver checkpoint inside that warning:

- a *continue* signal (SIGUSR1, SIGUSR2) checkpoints into
  ``<root>/<prefix><UTC time>-<signal>`` and resumes everyone;
- a *stop* signal (SIGTERM, SIGINT, SIGHUP) checkpoints with the commit's
  `stop` flag and no resume (every participant stays paused or stopped),
  then exits the conventional way: the previous handler is put back and the
  signal delivered again (default action: killed by the signal, status
  128+15 in a shell), or `on_stop` is called instead when one is given.

The grace budget (`grace_s`, counted from the signal) is cut into the
checkpoint's phase deadlines (`cut_budget`), so the checkpoint completes
inside it or fails whole; the Gym manifest is the commit point and `LATEST`
is written after it, so a failed one leaves the previous complete checkpoint
`latest`.  The driver stops waiting when the budget is spent.

A signal arriving while a signal checkpoint runs joins it (a stop signal
joining a continue checkpoint makes the process exit after it); a second stop
signal is logged and ignored until the budget is spent, and after that gives
up the wait.  Joining a checkpoint someone else started (periodic, manual) is
the coordinator's lock: ours waits for it, inside the budget.

Handlers never do I/O.  With a running event loop in the main thread they are
the loop's (`add_signal_handler`); without one (a synchronous training loop)
a daemon thread runs a loop for the checkpoint, and the Python-level handler
only schedules onto it.  `uninstall()` restores the previous handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from coordination.engine.baseline import Trigger
from coordination.engine.options import CheckpointOptions
from coordination.triggers.periodic import DEFAULT_PREFIX, checkpoint_name, episode_list, error_body
from coordination.triggers.signal_budget import (
    CONTINUE_SIGNALS,
    DEFAULT_GRACE_S,
    DEFAULT_SIGNALS,
    STOP_SIGNALS,
    Budget,
    SignalCheckpoint,
    check_signals,
    cut_budget,
)
from ray_ckpt.errors import DeadlineExceeded, InvalidRequest
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.blobstore.locations import join_location, open_location

log = logging.getLogger(__name__)

# Importers of these names from here keep working (they live in signal_budget).
__all__ = [
    "CONTINUE_SIGNALS",
    "DEFAULT_GRACE_S",
    "DEFAULT_SIGNALS",
    "STOP_SIGNALS",
    "Budget",
    "SignalCheckpoint",
    "SignalCheckpointing",
    "check_signals",
    "cut_budget",
]

Scope = Iterable[Any] | Callable[[], Iterable[Any]] | None
Handler = Callable[[int, Any], Any] | int | None


@dataclass
class _Run:
    sig: signal.Signals
    stop: bool
    location: str
    signalled_at: float
    exit_after: signal.Signals | None = None
    gave_up: bool = False
    joined: list[str] = field(default_factory=list)
    task: asyncio.Task[None] | None = None


class SignalCheckpointing:
    """See the module doc.  `handle` is a `CoordinatorHandle` (its `acheckpoint`,
    given one `CheckpointOptions`)."""

    def __init__(
        self,
        handle: Any,
        root: str,
        *,
        scope: Scope = None,
        signals: Iterable[int] = DEFAULT_SIGNALS,
        grace_s: float = DEFAULT_GRACE_S,
        prefix: str = DEFAULT_PREFIX,
        on_checkpoint: Callable[[SignalCheckpoint], None] | None = None,
        on_stop: Callable[[SignalCheckpoint], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(root, str) or not root:
            raise InvalidRequest(f"root must be a location, not {root!r}")
        open_location(root)  # touches nothing; a relative path or unknown scheme is refused
        if isinstance(grace_s, bool) or not isinstance(grace_s, int | float):
            raise InvalidRequest(f"grace_s must be a number of seconds, not {grace_s!r}")
        if not math.isfinite(grace_s) or grace_s <= 0:
            raise InvalidRequest(f"grace_s must be > 0 (got {grace_s!r})")
        self.handle = handle
        self.root = root
        self.scope = scope
        self.signals = check_signals(signals)
        self.grace_s = float(grace_s)
        self.prefix = prefix
        self.on_checkpoint = on_checkpoint
        self.on_stop = on_stop
        self.clock = clock
        self.outcomes: list[SignalCheckpoint] = []
        self._previous: dict[signal.Signals, Handler] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None  # our loop's, without a running one
        self._run: _Run | None = None
        self._exiting: signal.Signals | None = None
        self._last_name: str | None = None

    # --- installing -------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return self._loop is not None

    @property
    def running(self) -> bool:
        run = self._run
        return run is not None and run.task is not None and not run.task.done()

    def install(self) -> SignalCheckpointing:
        """Install the handlers (from the main thread); idempotent."""
        if self._loop is not None:
            return self
        if threading.current_thread() is not threading.main_thread():
            raise InvalidRequest("signal handlers can only be installed from the main thread")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=loop.run_forever, name="ray-ckpt-signals", daemon=True
            )
            self._thread.start()
        self._loop = loop
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            if self._thread is None:
                loop.add_signal_handler(sig, self._signalled, sig)
            else:
                signal.signal(sig, self._os_handler)
        log.info(
            "checkpoint on %s under %s (grace %gs)",
            "/".join(s.name for s in self.signals),
            self.root,
            self.grace_s,
        )
        return self

    def uninstall(self) -> None:
        """Restore the previous handlers (main thread); a checkpoint in flight
        is left to finish on its own (its deadlines bound it)."""
        loop, thread = self._loop, self._thread
        if loop is None:
            return
        for sig, prev in self._previous.items():
            if thread is None:
                loop.remove_signal_handler(sig)
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()
        self._loop = self._thread = None
        if thread is not None and thread is not threading.current_thread() and not self.running:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
            loop.close()

    # --- the handlers: scheduling only ----------------------------------------
    def _os_handler(self, signum: int, _frame: Any) -> None:
        """The Python-level handler of the thread mode (main thread)."""
        if self._exiting is not None and signum == self._exiting:
            self._exit_now(self._exiting)
        elif self._loop is not None:
            self._loop.call_soon_threadsafe(self._signalled, signal.Signals(signum))

    def _signalled(self, sig: signal.Signals) -> None:
        """On our loop: start a checkpoint, join the running one, or ignore."""
        now, stop = self.clock(), sig in STOP_SIGNALS
        run = self._run
        if run is not None and self.running:
            if stop and (run.stop or run.exit_after is not None):
                if now - run.signalled_at >= self.grace_s and run.task is not None:
                    log.warning("%s again and the grace budget is spent: giving up", sig.name)
                    run.gave_up = True
                    run.task.cancel()
                else:
                    log.warning(
                        "%s while the checkpoint on %s runs: ignored", sig.name, run.sig.name
                    )
                return
            log.info("%s joins the checkpoint on %s", sig.name, run.sig.name)
            run.joined.append(sig.name)
            if stop:
                run.exit_after = sig
            return
        if self._exiting is not None:
            log.warning("%s while exiting: ignored", sig.name)
            return
        run = _Run(sig, stop, self._location(sig), signalled_at=now)
        self._run = run
        loop = self._loop or asyncio.get_running_loop()
        run.task = loop.create_task(self._checkpoint(run))

    def _location(self, sig: signal.Signals) -> str:
        name = f"{checkpoint_name(self.prefix, time.time())}-{sig.name.lower()}"
        if self._last_name is not None and name <= self._last_name:
            name = f"{self._last_name}-1"  # two in one millisecond: still distinct, sorted
        self._last_name = name
        return join_location(self.root, name)

    # --- the checkpoint ---------------------------------------------------------
    async def _checkpoint(self, run: _Run) -> None:
        budget: Budget | None = None
        result: Any = None
        error: dict[str, Any] | None = None
        episodes = 0
        try:
            budget = cut_budget(self.grace_s, self.clock() - run.signalled_at)
            scope = self._scope()
            episodes = len(scope) if scope is not None else 0
            async with asyncio.timeout(budget.wait_s):
                result = await self.handle.acheckpoint(
                    CheckpointOptions(
                        checkpoint_dir=run.location,
                        scope=scope,
                        resume=not run.stop,
                        stop=run.stop,
                        prepare_s=budget.prepare_s,
                        commit_s=budget.commit_s,
                        total_s=budget.total_s,
                        trigger=Trigger.SIGNAL.value,
                    )
                )
        except TimeoutError:
            error = error_body(DeadlineExceeded(f"not complete inside {self.grace_s:g}s"))
        except asyncio.CancelledError:
            if not run.gave_up:
                raise
            error = error_body(DeadlineExceeded(f"grace budget of {self.grace_s:g}s spent"))
        except Exception as exc:
            error = error_body(exc)
        if result is not None:
            episodes = sum(len(v) for v in (result.continued, result.restart)) or episodes
        outcome = SignalCheckpoint(
            trigger=run.sig.name,
            stop=run.stop,
            location=run.location,
            ok=error is None,
            checkpoint_id=result.checkpoint_id if result is not None else None,
            episodes=episodes,
            seconds=self.clock() - run.signalled_at,
            grace_s=self.grace_s,
            prepare_s=budget.prepare_s if budget else 0.0,
            commit_s=budget.commit_s if budget else 0.0,
            joined=list(run.joined),
            error=error,
        )
        self.outcomes.append(outcome)
        if outcome.ok:
            log.info("checkpoint on %s: %s (%.2fs)", run.sig.name, run.location, outcome.seconds)
        else:
            log.error("checkpoint on %s failed; latest is unchanged: %s", run.sig.name, error)
        if self.on_checkpoint is not None:
            try:
                self.on_checkpoint(outcome)
            except Exception:
                log.exception("on_checkpoint failed")
        stop_sig = run.sig if run.stop else run.exit_after
        if stop_sig is not None:
            self._stopped(stop_sig, outcome)

    def _scope(self) -> list[EpisodeId] | None:
        scope = self.scope() if callable(self.scope) else self.scope
        return None if scope is None else episode_list(scope)

    # --- exiting ----------------------------------------------------------------
    def _stopped(self, sig: signal.Signals, outcome: SignalCheckpoint) -> None:
        self._exiting = sig
        if self.on_stop is not None:
            if self._thread is None:
                self.uninstall()  # a later SIGTERM acts as it did before us
            self.on_stop(outcome)
        elif self._thread is None:
            self._exit_now(sig)
        else:
            # signal.signal only works in the main thread: exit from there.
            signal.pthread_kill(threading.main_thread().ident or 0, sig)

    def _exit_now(self, sig: signal.Signals) -> None:
        """Main thread: restore the previous handler and deliver `sig` to it."""
        prev = self._previous.get(sig, signal.SIG_DFL)
        self.uninstall()
        if callable(prev):
            prev(sig, None)
            return
        if prev != signal.SIG_IGN:
            signal.raise_signal(sig)  # the default action: killed by the signal
        raise SystemExit(128 + sig)

    async def wait(self) -> SignalCheckpoint | None:
        """Wait for the checkpoint in flight (if any); its outcome."""
        run = self._run
        if run is None or run.task is None:
            return None
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(run.task)
        return self.outcomes[-1] if self.outcomes else None
