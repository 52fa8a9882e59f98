"""The handle's membership and status calls (`CoordinatorHandle` inherits them):
registering participants and the trainer's and assembler's pause targets,
discovery, status and ping, each with its async twin."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from coordination.results import CoordinatorStatus


class MemberCalls:
    _sync: Callable[..., Any]
    _async: Callable[..., Awaitable[Any]]

    def status(self) -> CoordinatorStatus:
        res: CoordinatorStatus = self._sync("status")
        return res

    async def astatus(self) -> CoordinatorStatus:
        res: CoordinatorStatus = await self._async("status")
        return res

    def register_actor(self, kind: str, name: str, handle: Any = None) -> str:
        key: str = self._sync("register_actor", kind, name, handle)
        return key

    async def aregister_actor(self, kind: str, name: str, handle: Any = None) -> str:
        key: str = await self._async("register_actor", kind, name, handle)
        return key

    def register_http(self, kind: str, name: str, url: str, token: str, **pool: int) -> str:
        key: str = self._sync("register_http", kind, name, url, token, **pool)
        return key

    async def aregister_http(self, kind: str, name: str, url: str, token: str, **pool: int) -> str:
        key: str = await self._async("register_http", kind, name, url, token, **pool)
        return key

    def discover_http(
        self, servers: list[tuple[str, str, str]], token: str, **pool: int
    ) -> dict[str, list[str]]:
        """Register the `(kind, name, url)` servers that are participants; a 404
        on status means "not a participant" (listed under "skipped")."""
        found: dict[str, list[str]] = self._sync("discover_http", servers, token, **pool)
        return found

    async def adiscover_http(
        self, servers: list[tuple[str, str, str]], token: str, **pool: int
    ) -> dict[str, list[str]]:
        found: dict[str, list[str]] = await self._async("discover_http", servers, token, **pool)
        return found

    def register_trainer(self, handle: Any, **options: Any) -> None:
        """`options`: pause_method, resume_method, pass_args, mode ("full"|"barrier")."""
        self._sync("register_pause", "trainer", handle, **options)

    async def aregister_trainer(self, handle: Any, **options: Any) -> None:
        await self._async("register_pause", "trainer", handle, **options)

    def register_assembler(self, handle: Any, **options: Any) -> None:
        """`options`: as `register_trainer`'s, plus scope_method (the method
        returning the episodes in flight: the scope of a checkpoint naming none)."""
        self._sync("register_pause", "assembler", handle, **options)

    async def aregister_assembler(self, handle: Any, **options: Any) -> None:
        await self._async("register_pause", "assembler", handle, **options)

    def discover(self) -> list[str]:
        keys: list[str] = self._sync("discover", refresh=True)
        return keys

    async def adiscover(self) -> list[str]:
        keys: list[str] = await self._async("discover", refresh=True)
        return keys

    def ping(self) -> str | None:
        """Wait until the coordinator is up (and has recovered)."""
        res: str | None = self._sync("ping")
        return res

    async def aping(self) -> str | None:
        res: str | None = await self._async("ping")
        return res
