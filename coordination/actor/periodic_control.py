"""The coordinator's periodic loop: start, stop, and run again after a restart.

`PeriodicControl` is what the `Coordinator` actor holds: the `PeriodicRunner`
(`coordination.triggers.periodic`), the root's up-front check, and the loop's settings
kept so a restarted coordinator runs it again.

Ray restarts the coordinator actor by re-running `__init__` (on any node, if
its node is lost); recovery then reads these settings and starts the same
loop, so a periodic run survives the coordinator like an open checkpoint
does.  They live beside the journal: in Ray's GCS KV store by default, or in
the journal's directory (`state_dir`) as one small object replaced
atomically.  `stop_periodic` clears them.  Only the same actor, restarted,
runs them again (`PeriodicConfig.actor_id`): a coordinator created anew under
the name forgets them.
"""

from __future__ import annotations

import asyncio
import logging
import os

import msgspec

from coordination.actor.gcs import GCS, kv_del, kv_get, kv_put
from coordination.engine.results import PeriodicStatus
from coordination.engine.roots import retain, writable
from coordination.triggers.periodic import DEFAULT_PREFIX, Checkpoint, PeriodicRunner
from ray_ckpt.clock import Clock
from ray_ckpt.storage.blobstore.blobs import BlobMissing
from ray_ckpt.storage.blobstore.locations import open_location

log = logging.getLogger(__name__)

MEMORY_NAME = "periodic.json"


class PeriodicConfig(msgspec.Struct, frozen=True):
    root: str
    every_s: float
    keep_latest_k: int | None
    prefix: str
    # The actor that ran it: Ray keeps an actor's ID across its restarts, so a
    # new coordinator of a later job (same name, new ID) never inherits the
    # loop of one that died with its driver.
    actor_id: str = ""


class PeriodicMemory:
    """Where the running loop's settings are kept, so a coordinator that Ray
    restarts (on any node) starts the same loop again: beside the journal, in
    Ray's GCS KV store by default or in the journal's directory."""

    def __init__(self, state_dir: str | None, *, namespace: str, name: str) -> None:
        # Relative like the journal's: to the actor's working directory.
        self.state_dir = None if state_dir in (None, GCS) else os.path.abspath(state_dir)
        self.key = f"periodic/{namespace}/{name}".encode()

    def save(self, config: PeriodicConfig) -> None:
        data = msgspec.json.encode(config)
        if self.state_dir is None:
            kv_put(self.key, data)
        else:
            open_location(self.state_dir).replace(MEMORY_NAME, data)

    def load(self) -> PeriodicConfig | None:
        if self.state_dir is None:
            data = kv_get(self.key)
        else:
            try:
                data = open_location(self.state_dir).read(MEMORY_NAME)
            except BlobMissing:
                data = None
        if data is None:
            return None
        try:
            return msgspec.json.decode(data, type=PeriodicConfig)
        except msgspec.DecodeError:
            log.warning("unreadable periodic settings ignored")
            return None

    def clear(self) -> None:
        if self.state_dir is None:
            kv_del(self.key)
        else:
            open_location(self.state_dir).delete([MEMORY_NAME])


class PeriodicControl:
    def __init__(
        self, checkpoint: Checkpoint, clock: Clock, memory: PeriodicMemory, actor_id: str
    ) -> None:
        self.runner = PeriodicRunner(checkpoint, retain, clock)
        self.memory = memory
        # Ray keeps an actor's ID across its restarts: whose settings are whose.
        self.actor_id = actor_id

    def status(self) -> PeriodicStatus | None:
        return self.runner.status()

    async def start(
        self,
        root: str,
        *,
        every_s: float,
        keep_latest_k: int | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> PeriodicStatus:
        """Check the root can be written, start the loop, remember it."""
        await writable(root)
        st = self.runner.start(root, every_s=every_s, keep_latest_k=keep_latest_k, prefix=prefix)
        config = PeriodicConfig(st.root, st.every_s, st.keep_latest_k, prefix, self.actor_id)
        try:
            await asyncio.to_thread(self.memory.save, config)
        except Exception:
            log.exception("periodic loop started, but a restarted coordinator will not know it")
        return st

    async def stop(self) -> PeriodicStatus | None:
        st = await self.runner.stop()
        await asyncio.to_thread(self.memory.clear)
        return st

    async def restart(self) -> None:
        """At recovery: the loop this actor ran before Ray restarted it, again;
        another actor's settings (a coordinator that died for good) forgotten."""
        try:
            config = await asyncio.to_thread(self.memory.load)
            if config is None:
                return
            if config.actor_id != self.actor_id:
                log.warning("forgot the periodic loop of another coordinator: %s", config)
                await asyncio.to_thread(self.memory.clear)
                return
            self.runner.start(
                config.root,
                every_s=config.every_s,
                keep_latest_k=config.keep_latest_k,
                prefix=config.prefix,
            )
            log.warning("periodic checkpoints under %s started again", config.root)
        except Exception:
            log.exception("the periodic loop of a previous coordinator could not be restarted")
