"""The admission gate a participant closes from prepare to resume.

Data-plane code either refuses while it is closed (`is_open`) or waits for it
to reopen (`wait_open`).  Awaiting `wait_open` on an open gate does not
suspend, so code that checks the gate and then acts synchronously cannot have
a close slip in between.
"""

from __future__ import annotations

import asyncio


class AdmissionGate:
    def __init__(self) -> None:
        self._opened = asyncio.Event()
        self._opened.set()

    @property
    def is_open(self) -> bool:
        return self._opened.is_set()

    def close(self) -> None:
        self._opened.clear()

    def open(self) -> None:
        self._opened.set()

    async def wait_open(self) -> None:
        # Loop: a close can follow the reopen before this waiter runs again.
        while not self._opened.is_set():
            await self._opened.wait()
