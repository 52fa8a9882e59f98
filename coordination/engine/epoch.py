"""The coordinator's epoch: a fencing token, so a superseded coordinator acts on nothing.

Ray restarts a coordinator whose node it declared dead, while the old process
may still run (a node cut off from the network, not dead).  Each coordinator
takes a new epoch when it starts or recovers, strictly greater than every
epoch taken before, from a store every incarnation shares (the GCS, by
`coordination.actor.gcs.GcsEpochs`; `MemoryEpochs` in process).  Then:

- every control call carries the epoch (`coordinator_epoch` in the body),
  and a participant refuses one older than the newest it has seen
  (`stale_coordinator`, `ray_ckpt.control.engine.ParticipantEngine.admit_epoch`);
- the coordinator confirms its epoch is still the newest before it opens a
  checkpoint or restore, before it writes a Gym manifest and before it moves
  `LATEST` (`CoordinatorEpoch.confirm`); a newer one, or a store that does
  not answer in time, refuses with `StaleCoordinator` and nothing is published.

The confirm is a read followed by a write, not one atomic step: a coordinator
superseded in the moment between the two still writes that one Gym
manifest.  Storage offers no conditional write on a token it does not know;
the window is one GCS round trip, and the participants' own refusal stops
every control call after it.

The engine stays without Ray: it is given a `CoordinatorEpoch` (or none:
nothing carries an epoch and nothing is confirmed, as before).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from ray_ckpt.errors import StaleCoordinator

# How long a confirm may wait for the store: a coordinator cut off from the
# GCS must not hang its publish, and one that cannot confirm does not publish.
CONFIRM_TIMEOUT_S = 10.0

# (blocking) the newest epoch taken so far in the shared store.
NewestEpoch = Callable[[], int]


class CoordinatorEpoch:
    """One coordinator incarnation's epoch, and how to ask whether it is still the newest."""

    def __init__(
        self, value: int, newest: NewestEpoch, *, timeout_s: float = CONFIRM_TIMEOUT_S
    ) -> None:
        self.value = value
        self._newest = newest
        self.timeout_s = timeout_s

    async def confirm(self, what: str) -> None:
        """Raise `StaleCoordinator` unless this epoch is still the newest taken.

        `what` names the act it guards (in the error).  The store is read in
        a thread, never on the loop; no answer within `timeout_s`, or a
        failing store, counts as not confirmed."""
        try:
            newest = await asyncio.wait_for(asyncio.to_thread(self._newest), self.timeout_s)
        except TimeoutError:
            raise StaleCoordinator(
                f"{what} refused: coordinator epoch {self.value} could not be confirmed "
                f"within {self.timeout_s:g}s (the epoch store did not answer)"
            ) from None
        except Exception as exc:
            # The store failing (a GCS that refuses the connection) is no
            # confirmation either; typed, so every caller handles it as stale.
            raise StaleCoordinator(
                f"{what} refused: coordinator epoch {self.value} could not be confirmed "
                f"(the epoch store failed: {exc!r})"[:500]
            ) from exc
        if newest != self.value:
            raise StaleCoordinator(
                f"{what} refused: coordinator epoch {self.value} is stale, epoch {newest} "
                "has taken over"
            )


class MemoryEpochs:
    """Epochs in process (tests, and coordinators that share one process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._newest = 0

    def take(self) -> int:
        with self._lock:
            self._newest += 1
            return self._newest

    def newest(self) -> int:
        with self._lock:
            return self._newest

    def epoch(self, *, timeout_s: float = CONFIRM_TIMEOUT_S) -> CoordinatorEpoch:
        """A new incarnation's epoch, taken now."""
        return CoordinatorEpoch(self.take(), self.newest, timeout_s=timeout_s)
