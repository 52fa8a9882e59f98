"""The handle's membership and status calls (`CoordinatorHandle` inherits them):
registering participants and the trainer's and assembler's pause targets,
discovery, status and ping, each with its async twin (`coordination.client.remote.twins`)."""

from __future__ import annotations

from typing import Any

from coordination.client.remote import Call, CoordinatorCalls, twins
from coordination.engine.results import CoordinatorStatus


class MemberCalls:
    _calls: CoordinatorCalls

    def _status(self) -> Call[CoordinatorStatus]:
        return Call("status")

    status, astatus = twins(_status)

    def _register_actor(self, kind: str, name: str, handle: Any = None) -> Call[str]:
        return Call("register_actor", kind, name, handle)

    register_actor, aregister_actor = twins(_register_actor)

    def _register_http(
        self, /, kind: str, name: str, url: str, token: str, **pool: int
    ) -> Call[str]:
        return Call("register_http", kind, name, url, token, **pool)

    register_http, aregister_http = twins(_register_http)

    def _discover_http(
        self, /, servers: list[tuple[str, str, str]], token: str, **pool: int
    ) -> Call[dict[str, list[str]]]:
        """Register the `(kind, name, url)` servers that are participants; a 404
        on status means "not a participant" (listed under "skipped")."""
        return Call("discover_http", servers, token, **pool)

    discover_http, adiscover_http = twins(_discover_http)

    def _register_trainer(self, /, handle: Any, **options: Any) -> Call[None]:
        """`options`: pause_method, resume_method, pass_args, mode ("full"|"barrier")."""
        return Call("register_pause", "trainer", handle, **options)

    register_trainer, aregister_trainer = twins(_register_trainer)

    def _register_assembler(self, /, handle: Any, **options: Any) -> Call[None]:
        """`options`: as `register_trainer`'s, plus scope_method (the method
        returning the episodes in flight: the scope of a checkpoint naming none)."""
        return Call("register_pause", "assembler", handle, **options)

    register_assembler, aregister_assembler = twins(_register_assembler)

    def _discover(self) -> Call[list[str]]:
        return Call("discover", refresh=True)

    discover, adiscover = twins(_discover)

    def _ping(self) -> Call[str | None]:
        """Wait until the coordinator is up (and has recovered)."""
        return Call("ping")

    ping, aping = twins(_ping)
