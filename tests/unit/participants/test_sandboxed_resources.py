"""The sandbox-owning resources participant (`participants.sandboxes.SandboxedResources`).

Real parts: the local `DirectorySandbox` over `tmp_path` (real files, real
processes), the test provider that declares `unsupported`, and a small tool
server (`Tools`) whose session state is a dict and whose requests run real
commands in the session's sandbox inside counted requests, each its own
asyncio task.  Each test drives the hooks the engine calls (close admission,
report, export, install, retire) in the order a checkpoint does.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import blake3
import msgspec
import pytest

from participants.sandboxes import LIVE_PROCESS, NOT_CAPTURED, SandboxedResources
from ray_ckpt.errors import InvalidCheckpointState, RestartInScope, SandboxFenced
from ray_ckpt.identity import EpisodeId
from ray_ckpt.sandbox.directory import DirectorySandbox
from ray_ckpt.sandbox.provider import SandboxHandle, SandboxProvider, SandboxSnapshot
from ray_ckpt.storage.records.record import Record
from tests.sandbox_providers import UnsupportedSandbox
from tests.unit.helpers import until

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
R0, R1 = EpisodeId("r0"), EpisodeId("r1")


class Tools:
    """A tool server: its `SessionHooks` (a dict per session) and its requests,
    each a counted request that works in the session's sandbox."""

    def __init__(self, provider: SandboxProvider) -> None:
        self.part = SandboxedResources(self, provider)
        self.provider = provider
        self.states: dict[EpisodeId, dict[str, Any]] = {}
        self.asked: list[list[EpisodeId]] = []  # what each export asked for
        self.refuse_restore = False
        self.retired: list[EpisodeId] = []
        self.background: dict[EpisodeId, int] = {}

    # --- SessionHooks ----------------------------------------------------------

    async def export_session_states(self, keys: Sequence[EpisodeId]) -> dict[EpisodeId, Any]:
        self.asked.append(list(keys))
        return {k: dict(self.states[k]) for k in keys if k in self.states}

    async def restore_session_states(self, states: Mapping[EpisodeId, Any]) -> None:
        if self.refuse_restore:
            raise InvalidCheckpointState("the tool server refuses these states")
        for key, state in states.items():
            self.states[key] = dict(state)

    async def retire_session_state(self, key: EpisodeId) -> None:
        self.retired.append(key)
        self.states.pop(key, None)

    # --- requests ----------------------------------------------------------------

    async def open(self, eid: EpisodeId, *, background: bool = False) -> None:
        """Seed a session: its sandbox, `a.txt`, and a background process if asked."""
        ticket = await self.part.enter(eid, "/seed")
        try:
            self.part.bind_session(eid)
            handle = await self.part.sandboxes.create(eid)
            await self.provider.write_file(handle, "a.txt", f"{eid} a\n".encode())
            if background:
                ran = await self.provider.run(handle, SLEEPER, timeout_s=60, background=True)
                assert ran.pid is not None
                self.background[eid] = ran.pid
            self.states[eid] = {"calls": 1}
        finally:
            self.part.leave(ticket)

    async def write(self, eid: EpisodeId, path: str, data: bytes) -> None:
        ticket = await self.part.enter(eid, "/write")
        try:
            await self.provider.write_file(self.mine(eid), path, data)
            self.states[eid]["calls"] += 1
        finally:
            self.part.leave(ticket)

    async def sleep(self, eid: EpisodeId, started: asyncio.Event) -> None:
        """A request that runs a foreground command until it is cancelled."""
        ticket = await self.part.enter(eid, "/sleep")
        try:
            started.set()
            await self.provider.run(self.mine(eid), SLEEPER, timeout_s=60)
        finally:
            self.part.leave(ticket)

    def mine(self, eid: EpisodeId) -> SandboxHandle:
        handle = self.part.sandboxes.handle(eid)
        assert handle is not None
        return handle


class Providers:
    """Providers over roots under `tmp_path`, closed at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.made: list[DirectorySandbox | UnsupportedSandbox] = []

    def directory(self, name: str) -> DirectorySandbox:
        provider = DirectorySandbox(self.tmp / name)
        self.made.append(provider)
        return provider

    def unsupported(self, name: str) -> UnsupportedSandbox:
        provider = UnsupportedSandbox(self.tmp / name)
        self.made.append(provider)
        return provider


@pytest.fixture
async def providers(tmp_path: Path) -> AsyncIterator[Providers]:
    made = Providers(tmp_path)
    yield made
    for provider in made.made:
        await provider.close()  # kills what a test left running


@pytest.fixture
def tools(providers: Providers) -> Tools:
    return Tools(providers.directory("root"))


def trees(provider: SandboxProvider) -> list[str]:
    """The sandboxes' directories a provider holds on disk."""
    inner = provider.inner if isinstance(provider, UnsupportedSandbox) else provider
    assert isinstance(inner, DirectorySandbox)
    return sorted(os.listdir(os.path.join(inner.root, "trees")))


def snapshot_of(record: Record) -> SandboxSnapshot:
    return msgspec.convert(record.state["sandbox"], SandboxSnapshot)


async def exported(tools: Tools, *eids: EpisodeId) -> list[Record]:
    """Open these sessions and export them at a closed checkpoint."""
    for eid in eids:
        await tools.open(eid)
    tools.part.close_admission()
    assert tools.part.ready()
    return await tools.part.export(None)


async def test_export_carries_each_session_state_with_its_sandbox(tools: Tools) -> None:
    await tools.open(R0)
    await tools.open(R1)
    await tools.write(R1, "b.txt", b"b\n")
    tools.part.close_admission()
    assert tools.part.report(10).restarts == []

    records = await tools.part.export(None)

    assert [r.key for r in records] == ["r0", "r1"]
    assert [r.state["session"] for r in records] == [{"calls": 1}, {"calls": 2}]
    files = [["a.txt"], ["a.txt", "b.txt"]]
    for record, names in zip(records, files, strict=True):
        snapshot = snapshot_of(record)
        assert snapshot.provider == tools.provider.name
        assert sorted(e.path for e in snapshot.entries if e.kind == "file") == names
        assert record.attachments is not None
        assert set(record.attachments) == snapshot.digests()
        for digest, path in record.attachments.items():
            with open(path, "rb") as f:  # noqa: ASYNC230 - a small file of the test's own
                assert blake3.blake3(f.read()).hexdigest() == digest
    assert tools.part.sandboxes.captures == 2


async def test_a_session_without_a_sandbox_exports_its_state_alone(tools: Tools) -> None:
    plain = EpisodeId("plain")
    tools.part.bind_session(plain)
    tools.states[plain] = {"calls": 0}
    (record,) = await exported(tools)
    assert record.key == "plain"
    assert record.state == {"session": {"calls": 0}}
    assert record.attachments is None


async def test_a_live_process_at_the_boundary_makes_a_restart_never_exported(
    tools: Tools,
) -> None:
    live, quiet = EpisodeId("live"), EpisodeId("quiet")
    await tools.open(live, background=True)
    await tools.open(quiet)
    tools.part.close_admission()

    assert tools.part.report(10).restarts == ["live"]
    assert tools.part.restart_reasons() == {"live": LIVE_PROCESS}
    with pytest.raises(RestartInScope):
        await tools.part.export([live, quiet])
    assert [r.key for r in await tools.part.export(None)] == ["quiet"]
    assert [r.key for r in await tools.part.export([quiet])] == ["quiet"]
    # The hooks were never asked for the live session's state.
    assert tools.asked == [[quiet], [quiet]]
    assert tools.part.sandboxes.captures == 2


async def test_a_session_mid_request_is_decided_once_its_request_ends(tools: Tools) -> None:
    await tools.open(R0)
    started = asyncio.Event()
    request = asyncio.ensure_future(tools.sleep(R0, started))
    try:
        await started.wait()
        await until(lambda: tools.part.sandboxes.provider.alive(tools.mine(R0)))
        tools.part.close_admission()
        # A command runs inside a counted request: a blocker, not a restart.
        report = tools.part.report(10)
        assert not report.ready
        assert report.restarts == []
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
        await until(lambda: not tools.provider.alive(tools.mine(R0)))
        assert tools.part.ready()
        assert tools.part.report(10).restarts == []
        assert [r.key for r in await tools.part.export(None)] == ["r0"]
    finally:
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)


async def test_a_request_during_a_checkpoint_waits_for_the_resume(tools: Tools) -> None:
    await tools.open(R0)
    tools.part.close_admission()
    late = asyncio.ensure_future(tools.write(R0, "late.txt", b"late\n"))
    await asyncio.sleep(0.05)
    assert not late.done()
    (record,) = await tools.part.export(None)
    # The capture never saw the waiting request's file.
    assert [e.path for e in snapshot_of(record).entries if e.kind == "file"] == ["a.txt"]
    tools.part.open_admission()
    await asyncio.wait_for(late, 10)
    assert await tools.provider.read_file(tools.mine(R0), "late.txt") == b"late\n"


async def test_with_an_unsupported_provider_every_sandboxed_session_restarts(
    providers: Providers,
) -> None:
    provider = providers.unsupported("root")
    tools = Tools(provider)
    plain = EpisodeId("plain")
    tools.part.bind_session(plain)
    tools.states[plain] = {"calls": 0}
    await tools.open(R0)
    await tools.open(R1)
    tools.part.close_admission()

    assert tools.part.report(10).restarts == ["r0", "r1"]
    assert tools.part.restart_reasons() == {"r0": NOT_CAPTURED, "r1": NOT_CAPTURED}
    assert [r.key for r in await tools.part.export(None)] == ["plain"]
    with pytest.raises(RestartInScope):
        await tools.part.export([R0])
    assert provider.captures == 0  # never asked


async def test_restore_installs_each_session_with_its_sandbox_as_the_next_generation(
    tools: Tools, providers: Providers
) -> None:
    records = await exported(tools, R0, R1)
    provider = providers.directory("fresh")
    fresh = Tools(provider)

    installed = await fresh.part.install(records)

    assert sorted(installed) == [R0.next(), R1.next()]
    assert fresh.states == {R0.next(): {"calls": 1}, R1.next(): {"calls": 1}}
    assert sorted(fresh.part.sessions) == [R0.next(), R1.next()]
    for eid in (R0, R1):
        handle = fresh.mine(eid.next())
        assert handle.generation == 1
        assert await provider.read_file(handle, "a.txt") == f"{eid} a\n".encode()
    # The continuation works on in its restored sandbox.
    await fresh.write(R0.next(), "b.txt", b"b\n")
    assert await provider.read_file(fresh.mine(R0.next()), "b.txt") == b"b\n"
    assert fresh.states[R0.next()] == {"calls": 2}


async def test_restore_with_one_corrupt_file_installs_nothing(
    tools: Tools, providers: Providers, tmp_path: Path
) -> None:
    records = await exported(tools, R0, R1)
    # r1's file, as the checkpoint hands it back, is not what its digest says.
    bad = tmp_path / "corrupt"
    assert records[1].attachments is not None
    ((digest, _),) = records[1].attachments.items()
    bad.write_bytes(b"r1 A\n")  # same size, other bytes
    broken = [records[0], Record(records[1].key, records[1].state, None, {digest: str(bad)})]
    provider = providers.directory("fresh")
    fresh = Tools(provider)

    with pytest.raises(InvalidCheckpointState):
        await fresh.part.install(broken)

    # Nothing installed: no session state, no session, no sandbox, no tree.
    assert fresh.states == {}
    assert fresh.part.sessions == set()
    assert fresh.part.sandboxes.held() == []
    assert trees(provider) == []
    assert fresh.part.fresh()
    # The same process restores the intact checkpoint afterwards.
    assert sorted(await fresh.part.install(records)) == [R0.next(), R1.next()]
    assert sorted(fresh.states) == [R0.next(), R1.next()]
    assert len(trees(provider)) == 2


async def test_a_session_state_the_hooks_refuse_frees_the_sandboxes_made(
    tools: Tools, providers: Providers
) -> None:
    records = await exported(tools, R0, R1)
    provider = providers.directory("fresh")
    fresh = Tools(provider)
    fresh.refuse_restore = True

    with pytest.raises(InvalidCheckpointState):
        await fresh.part.install(records)

    assert fresh.states == {}
    assert fresh.part.sessions == set()
    assert fresh.part.sandboxes.held() == []
    assert trees(provider) == []


async def test_a_malformed_session_record_is_refused_before_any_sandbox_is_made(
    tools: Tools, providers: Providers
) -> None:
    (record,) = await exported(tools, R0)
    provider = providers.directory("fresh")
    fresh = Tools(provider)
    no_session = {k: v for k, v in record.state.items() if k != "session"}
    cases = [
        Record(record.key, no_session, None, record.attachments),
        Record(record.key, {**record.state, "sandbox": {"provider": 3}}, None, record.attachments),
        Record(record.key, record.state, None, {}),  # its files are missing
    ]
    for bad in cases:
        with pytest.raises(InvalidCheckpointState):
            await fresh.part.install([bad])
        assert fresh.states == {}
        assert fresh.part.sandboxes.held() == []
        assert trees(provider) == []


async def test_an_old_generation_is_fenced_after_a_restore_and_freed_on_retire(
    tools: Tools,
) -> None:
    records = await exported(tools, R0)
    old = tools.mine(R0)
    provider = tools.provider

    # A restore in this very process (one provider): the generation it
    # replaces is fenced, whoever still holds its handle.
    fresh = Tools(provider)
    await fresh.part.install(records)
    new = fresh.mine(R0.next())
    assert new.generation == old.generation + 1
    with pytest.raises(SandboxFenced):
        await provider.run(old, ["true"], timeout_s=5)
    with pytest.raises(SandboxFenced):
        await provider.write_file(old, "x.txt", b"late\n")
    assert await provider.read_file(new, "a.txt") == b"r0 a\n"
    assert len(trees(provider)) == 2

    # Retiring the old attempt frees its generation; the new one stays.
    assert "r0" in await fresh.part.retire([R0])
    assert fresh.mine(R0.next()) == new
    assert len(trees(provider)) == 1
    await fresh.part.retire([R0.next()])
    assert fresh.part.sandboxes.held() == []
    assert trees(provider) == []


async def test_retire_stops_the_requests_and_frees_the_sandbox_before_it_replies(
    tools: Tools,
) -> None:
    await tools.open(R0, background=True)
    started = asyncio.Event()
    request = asyncio.ensure_future(tools.sleep(R0, started))
    await started.wait()
    handle = tools.mine(R0)
    assert tools.provider.alive(handle)
    assert len(trees(tools.provider)) == 1

    keys = await tools.part.retire([R0])

    assert keys == ["r0"]
    assert request.done()
    assert tools.retired == [R0]
    assert not tools.provider.alive(handle)
    with pytest.raises(ProcessLookupError):
        os.killpg(tools.background[R0], 0)
    assert trees(tools.provider) == []
    assert tools.part.sandboxes.held() == []
    assert tools.part.sessions == set()


async def test_an_ended_session_and_an_unkept_restored_one_free_their_sandboxes(
    tools: Tools, providers: Providers
) -> None:
    records = await exported(tools, R0, R1)
    provider = providers.directory("fresh")
    fresh = Tools(provider)
    await fresh.part.install(records)
    assert len(trees(provider)) == 2

    assert await fresh.part.delete_restored([R0.next()]) == ["r1-a1"]
    assert fresh.part.sandboxes.held() == [R0.next()]
    assert len(trees(provider)) == 1

    assert await fresh.part.end_session(R0.next())
    assert fresh.part.sandboxes.held() == []
    assert trees(provider) == []


async def test_a_stop_commit_frees_the_exported_sandboxes(tools: Tools) -> None:
    records = await exported(tools, R0)
    await tools.part.park_exported(records)
    assert tools.part.sandboxes.held() == []
    assert trees(tools.provider) == []
