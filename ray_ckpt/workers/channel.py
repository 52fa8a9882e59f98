"""Requests and one-way messages in both directions over one frame stream.

Each side may `call` (a request with an ID, answered by a reply with the same
ID, bounded by a timeout) or `send` (no reply: reports, heartbeats).  Incoming
requests run as tasks on the receiving side's `handler`; its exception goes
back as an error reply and is raised by the caller as a `ChannelError` naming
it (a `CheckpointError` keeps its code).  When the stream ends every pending
call fails at once with `ChannelClosed`: a peer's death is never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ray_ckpt.errors import CheckpointError, ParticipantUnavailable, error_from_code
from ray_ckpt.workers.frames import DEFAULT_MAX_FRAME_BYTES, FrameError, encode, read_frame

log = logging.getLogger(__name__)

# How long a request may take before the caller gives up on the peer.
MESSAGE_TIMEOUT_S = 30.0

Handler = Callable[[str, dict[str, Any]], Awaitable[Any]]
OneWay = Callable[[str, dict[str, Any]], None]


class ChannelClosed(ParticipantUnavailable):
    """The peer is gone (its process died, or it closed the connection)."""


class Channel:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        handler: Handler,
        on_message: OneWay,
        name: str,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self._on_message = on_message
        self.name = name
        self._max = max_frame_bytes
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._write_lock = asyncio.Lock()
        self.closed = asyncio.Event()
        self._reading: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reading = asyncio.get_running_loop().create_task(self._read_loop())

    async def call(
        self, op: str, body: dict[str, Any], timeout_s: float = MESSAGE_TIMEOUT_S
    ) -> Any:
        if self.closed.is_set():
            raise ChannelClosed(f"{self.name}: connection closed")
        rid = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            await self._write({"id": rid, "op": op, "body": body})
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            raise ParticipantUnavailable(
                f"{self.name}: no reply to {op} within {timeout_s:g} s"
            ) from None
        finally:
            self._pending.pop(rid, None)

    async def send(self, op: str, body: dict[str, Any]) -> None:
        """One-way; silently dropped if the channel is closed."""
        if self.closed.is_set():
            return
        with contextlib.suppress(ChannelClosed):
            await self._write({"op": op, "body": body})

    async def _write(self, message: dict[str, Any]) -> None:
        frame = encode(message, self._max)
        async with self._write_lock:
            try:
                self._writer.write(frame)
                await self._writer.drain()
            except (ConnectionError, RuntimeError) as exc:
                self._close()
                raise ChannelClosed(f"{self.name}: write failed: {exc!r}") from None

    async def _read_loop(self) -> None:
        try:
            while True:
                message = await read_frame(self._reader, self._max)
                self._dispatch(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except FrameError:
            log.warning("%s: bad frame; closing", self.name, exc_info=True)
        finally:
            self._close()

    def _dispatch(self, message: Any) -> None:
        if not isinstance(message, dict):
            raise FrameError("a frame must hold a map")
        if "re" in message:
            future = self._pending.get(message["re"])
            if future is not None and not future.done():
                error = message.get("error")
                if error is None:
                    future.set_result(message.get("body"))
                else:
                    future.set_exception(error_from_code(str(error[0]), str(error[1])))
            return
        op, body = str(message.get("op")), message.get("body") or {}
        if "id" not in message:
            self._on_message(op, body)
            return
        task = asyncio.get_running_loop().create_task(self._answer(message["id"], op, body))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, rid: int, op: str, body: dict[str, Any]) -> None:
        reply: dict[str, Any] = {"re": rid}
        try:
            reply["body"] = await self._handler(op, body)
        except CheckpointError as exc:
            reply["error"] = [exc.code, exc.detail]
        except Exception as exc:
            log.warning("%s: %s failed", self.name, op, exc_info=True)
            reply["error"] = ["invalid_checkpoint_state", f"{op} failed: {exc!r}"]
        with contextlib.suppress(ChannelClosed, FrameError):
            await self._write(reply)

    def _close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ChannelClosed(f"{self.name}: connection lost"))
        with contextlib.suppress(Exception):
            self._writer.close()

    async def aclose(self) -> None:
        self._close()
        for task in [*self._tasks, *([self._reading] if self._reading else [])]:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._reading is not None:
            await asyncio.gather(self._reading, return_exceptions=True)
