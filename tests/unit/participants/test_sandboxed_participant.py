"""The sandbox-owning environment participant (`participants.sandboxes`), in process.

Real parts: `EpisodeSteps` episodes run by their own asyncio tasks, the local
`DirectorySandbox` over `tmp_path` (real files, real processes), and the
test provider that declares `unsupported`.  Each test drives the hooks the
engine calls (close admission, report, export, install, retire) in the
order a checkpoint does.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import blake3
import msgspec
import pytest

from participants.sandboxes import LIVE_PROCESS, NOT_CAPTURED, SandboxedEnvironment
from ray_ckpt.errors import InvalidCheckpointState, InvalidPhase, RestartInScope, SandboxFenced
from ray_ckpt.identity import EpisodeId
from ray_ckpt.sandbox.directory import DirectorySandbox
from ray_ckpt.sandbox.provider import SandboxProvider, SandboxSnapshot
from ray_ckpt.steps import EpisodeSteps
from ray_ckpt.storage.records.record import Record
from tests.sandbox_providers import UnsupportedSandbox
from tests.unit.helpers import until

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


class Episodes:
    """Episodes of one participant, each its own task: step 0 (wait) makes the
    sandbox and writes `a.txt` (and starts a background process if asked),
    then waits for `go`; step 1 writes `b.txt`.  A restored attempt skips
    step 0 and goes on in its restored sandbox."""

    def __init__(self, part: SandboxedEnvironment) -> None:
        self.part = part
        self.provider = part.sandboxes.provider
        self.go = asyncio.Event()
        self.tasks: dict[EpisodeId, asyncio.Task[None]] = {}
        self.background: dict[EpisodeId, int] = {}  # the background process group

    def start(self, eid: EpisodeId, *, background: bool = False) -> None:
        self.tasks[eid] = asyncio.ensure_future(self._run(eid, background))

    async def _run(self, eid: EpisodeId, background: bool) -> None:
        ep = self.part.steps.begin(eid, boundary={"next": 0})
        async with ep:
            if ep.claim() is None:
                async with ep.step("wait", name="setup") as st:
                    handle = await self.part.sandboxes.create(eid)
                    await self.provider.write_file(handle, "a.txt", f"{eid} a\n".encode())
                    if background:
                        ran = await self.provider.run(
                            handle, SLEEPER, timeout_s=60, background=True
                        )
                        assert ran.pid is not None
                        self.background[eid] = ran.pid
                    await self.go.wait()
                    st.boundary({"next": 1})
            mine = self.part.sandboxes.handle(eid)
            assert mine is not None
            async with ep.step("wait", name="finish") as st:
                await self.provider.write_file(mine, "b.txt", b"b\n")
                st.boundary({"next": "done"})

    async def at_boundary(self, *eids: EpisodeId) -> None:
        """Close admission while each is mid-step, then let the steps end: each
        parks at its boundary after step 0 and the participant is ready."""
        await until(lambda: all(self.part.sandboxes.handle(e) is not None for e in eids))
        self.part.close_admission()
        self.go.set()
        await until(self.part.ready)

    async def stop(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


def participant(provider: SandboxProvider) -> SandboxedEnvironment:
    return SandboxedEnvironment(EpisodeSteps(), provider)


class Providers:
    """Directory providers over roots under `tmp_path`, closed at the end."""

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
async def local(providers: Providers) -> AsyncIterator[tuple[SandboxedEnvironment, Episodes]]:
    part = participant(providers.directory("root"))
    episodes = Episodes(part)
    yield part, episodes
    await episodes.stop()


def trees(provider: SandboxProvider) -> list[str]:
    """The sandboxes' directories a provider holds on disk."""
    inner = provider.inner if isinstance(provider, UnsupportedSandbox) else provider
    assert isinstance(inner, DirectorySandbox)
    return sorted(os.listdir(os.path.join(inner.root, "trees")))


def snapshot_of(record: Record) -> SandboxSnapshot:
    return msgspec.convert(record.state["sandbox"], SandboxSnapshot)


Local = tuple[SandboxedEnvironment, Episodes]
R0, R1 = EpisodeId("r0"), EpisodeId("r1")


async def test_export_carries_each_sandbox_snapshot_and_its_files(local: Local) -> None:
    part, episodes = local
    episodes.start(R0)
    episodes.start(R1)
    await episodes.at_boundary(R0, R1)
    assert part.report(10).restarts == []

    records = await part.export(None)

    assert [r.key for r in records] == ["r0", "r1"]
    for record in records:
        assert record.state["boundary"] == {"next": 1}
        assert record.version is None
        snapshot = snapshot_of(record)
        assert snapshot.provider == part.sandboxes.provider.name
        assert [e.path for e in snapshot.entries if e.kind == "file"] == ["a.txt"]
        assert record.attachments is not None
        assert set(record.attachments) == snapshot.digests()
        ((digest, path),) = record.attachments.items()
        with open(path, "rb") as f:  # noqa: ASYNC230 - a small file of the test's own
            data = f.read()
        assert data == f"{record.key} a\n".encode()
        assert blake3.blake3(data).hexdigest() == digest
    assert part.sandboxes.captures == 2
    # The episodes' own records are the environment's, with the snapshot added.
    assert [r.state["step"] for r in records] == [1, 1]


async def test_a_live_process_at_the_boundary_makes_a_restart_never_exported(
    local: Local,
) -> None:
    part, episodes = local
    live, quiet = EpisodeId("live"), EpisodeId("quiet")
    episodes.start(live, background=True)
    episodes.start(quiet)
    await episodes.at_boundary(live, quiet)

    assert part.report(10).restarts == ["live"]
    assert part.restart_reasons() == {"live": LIVE_PROCESS}
    with pytest.raises(RestartInScope):
        await part.export([live, quiet])
    assert [r.key for r in await part.export(None)] == ["quiet"]
    assert [r.key for r in await part.export([quiet])] == ["quiet"]
    assert part.sandboxes.captures == 2  # never the live one's


async def test_the_decision_holds_for_the_open_checkpoint_after_the_process_ends(
    local: Local,
) -> None:
    part, episodes = local
    live = EpisodeId("live")
    episodes.start(live, background=True)
    await episodes.at_boundary(live)
    assert part.report(10).restarts == ["live"]
    handle = part.sandboxes.handle(live)
    assert handle is not None
    os.killpg(episodes.background[live], signal.SIGKILL)
    await until(lambda: not part.sandboxes.provider.alive(handle))

    # The export agrees with what this checkpoint's prepare reported.
    assert part.report(10).restarts == ["live"]
    assert await part.export(None) == []
    with pytest.raises(RestartInScope):
        await part.export([live])
    # The next checkpoint decides afresh: nothing runs in it now.
    part.open_admission()
    part.close_admission()
    assert part.report(10).restarts == []
    assert [r.key for r in await part.export(None)] == ["live"]


async def test_an_episode_mid_step_is_decided_once_it_reaches_its_boundary(
    local: Local,
) -> None:
    part, episodes = local
    live = EpisodeId("live")
    episodes.start(live, background=True)
    await until(lambda: live in episodes.background)
    part.close_admission()
    # Its step is still running (a blocker): no decision yet.
    report = part.report(10)
    assert not report.ready
    assert report.restarts == []
    episodes.go.set()
    await until(part.ready)
    assert part.report(10).restarts == ["live"]


async def test_with_an_unsupported_provider_every_sandboxed_episode_restarts(
    providers: Providers,
) -> None:
    provider = providers.unsupported("root")
    part = participant(provider)
    episodes = Episodes(part)
    try:
        episodes.start(R0)
        episodes.start(R1)
        await episodes.at_boundary(R0, R1)
        assert part.report(10).restarts == ["r0", "r1"]
        assert part.restart_reasons() == {"r0": NOT_CAPTURED, "r1": NOT_CAPTURED}
        assert await part.export(None) == []
        with pytest.raises(RestartInScope):
            await part.export([R0])
        assert provider.captures == 0  # never asked
    finally:
        await episodes.stop()


async def test_restore_installs_every_sandbox_as_the_next_generation(
    local: Local, providers: Providers
) -> None:
    part, episodes = local
    episodes.start(R0)
    episodes.start(R1)
    await episodes.at_boundary(R0, R1)
    records = await part.export(None)

    fresh = participant(providers.directory("fresh"))
    installed = await fresh.install(records)

    assert sorted(installed) == [R0.next(), R1.next()]
    assert fresh.steps.restored_ids() == [R0.next(), R1.next()]
    provider = fresh.sandboxes.provider
    for eid in (R0, R1):
        handle = fresh.sandboxes.handle(eid.next())
        assert handle is not None
        assert handle.generation == 1
        assert await provider.read_file(handle, "a.txt") == f"{eid} a\n".encode()
    # A second checkpoint before the continuation begins captures the
    # restored sandbox again, under the continuing attempt.
    fresh.close_admission()
    again = await fresh.export(None)
    assert [r.key for r in again] == ["r0-a1", "r1-a1"]
    assert [snapshot_of(r).generation for r in again] == [1, 1]
    assert [r.state["boundary"] for r in again] == [{"next": 1}, {"next": 1}]
    fresh.open_admission()
    # The continuation runs on in its restored sandbox; its end frees it.
    cont = Episodes(fresh)
    cont.start(R0.next())
    await asyncio.wait_for(cont.tasks[R0.next()], 10)
    handle = fresh.sandboxes.handle(R0.next())
    assert handle is not None
    assert await provider.read_file(handle, "b.txt") == b"b\n"
    await fresh.release(R0.next())
    assert fresh.sandboxes.held() == [R1.next()]
    assert len(trees(provider)) == 1


async def test_restore_is_all_or_nothing_when_one_snapshot_file_is_corrupt(
    local: Local, providers: Providers, tmp_path: Path
) -> None:
    part, episodes = local
    episodes.start(R0)
    episodes.start(R1)
    await episodes.at_boundary(R0, R1)
    records = await part.export(None)
    # r1's file, as the checkpoint hands it back, is not what its digest says.
    bad = tmp_path / "corrupt"
    assert records[1].attachments is not None
    ((digest, _),) = records[1].attachments.items()
    bad.write_bytes(b"r1 A\n")  # same size, other bytes
    records[1] = Record(records[1].key, records[1].state, None, {digest: str(bad)})

    provider = providers.directory("fresh")
    fresh = participant(provider)
    with pytest.raises(InvalidCheckpointState):
        await fresh.install(records)

    # Nothing activated: no episode, no sandbox, no tree; still fresh.
    assert fresh.steps.restored_ids() == []
    assert fresh.sandboxes.held() == []
    assert trees(provider) == []
    assert fresh.fresh()
    # The same process restores the intact checkpoint afterwards.
    good = await part.export(None)
    assert sorted(await fresh.install(good)) == [R0.next(), R1.next()]
    assert len(trees(provider)) == 2


async def test_an_install_that_fails_after_the_sandboxes_are_made_frees_them(
    local: Local, providers: Providers
) -> None:
    part, episodes = local
    episodes.start(R0)
    await episodes.at_boundary(R0)
    records = await part.export(None)
    provider = providers.directory("fresh")
    fresh = participant(provider)
    # The episodes' own install refuses (this table has served an episode),
    # after every sandbox was restored: they are freed, nothing stays.
    fresh.steps.begin(EpisodeId("other")).close()
    with pytest.raises(InvalidPhase):
        await fresh.install(records)
    assert fresh.sandboxes.held() == []
    assert trees(provider) == []
    assert fresh.steps.restored_ids() == []


async def test_malformed_snapshots_are_refused_before_any_sandbox_is_made(
    local: Local, providers: Providers
) -> None:
    part, episodes = local
    episodes.start(R0)
    await episodes.at_boundary(R0)
    (record,) = await part.export(None)
    provider = providers.directory("fresh")
    fresh = participant(provider)
    state = record.state
    cases = [
        Record(record.key, {**state, "sandbox": {"provider": 3}}, None, record.attachments),
        Record(record.key, state, None, {}),  # its files are missing
        Record(
            record.key,
            {**state, "sandbox": {**state["sandbox"], "provider": "other"}},
            None,
            record.attachments,
        ),
        Record(record.key, {**state, "boundary": None, "step": -1}, None, record.attachments),
    ]
    for bad in cases:
        with pytest.raises(InvalidCheckpointState):
            await fresh.install([bad])
        assert fresh.sandboxes.held() == []
        assert fresh.steps.restored_ids() == []
        assert trees(provider) == []


async def test_an_old_generation_is_fenced_after_a_restore_and_freed_on_retire(
    local: Local,
) -> None:
    part, episodes = local
    episodes.start(R0)
    await episodes.at_boundary(R0)
    old = part.sandboxes.handle(R0)
    assert old is not None
    records = await part.export(None)
    provider = part.sandboxes.provider

    # A restore in this very process (one provider): the generation it
    # replaces is fenced, whoever still holds its handle.
    fresh = participant(provider)
    await fresh.install(records)
    new = fresh.sandboxes.handle(R0.next())
    assert new is not None
    assert new.generation == old.generation + 1
    with pytest.raises(SandboxFenced):
        await provider.run(old, ["true"], timeout_s=5)
    with pytest.raises(SandboxFenced):
        await provider.write_file(old, "x.txt", b"late\n")
    assert await provider.read_file(new, "a.txt") == b"r0 a\n"
    assert len(trees(provider)) == 2

    # Retiring the old attempt frees its generation; the new one stays.
    assert "r0" in await fresh.retire([R0])
    assert fresh.sandboxes.handle(R0.next()) == new
    assert len(trees(provider)) == 1
    assert await provider.read_file(new, "a.txt") == b"r0 a\n"
    await fresh.retire([R0.next()])
    assert fresh.sandboxes.held() == []
    assert trees(provider) == []
    with pytest.raises(SandboxFenced):
        await provider.read_file(new, "a.txt")


async def test_retire_stops_the_processes_and_frees_the_files_before_it_replies(
    local: Local,
) -> None:
    part, episodes = local
    episodes.start(R0, background=True)
    await until(lambda: R0 in episodes.background)
    handle = part.sandboxes.handle(R0)
    assert handle is not None
    provider = part.sandboxes.provider
    assert provider.alive(handle)
    assert len(trees(provider)) == 1

    keys = await part.retire([R0])

    assert keys == ["r0"]
    assert episodes.tasks[R0].done()
    assert not provider.alive(handle)
    with pytest.raises(ProcessLookupError):
        os.killpg(episodes.background[R0], 0)
    assert trees(provider) == []
    assert part.sandboxes.held() == []


async def test_an_unscoped_restored_sandbox_is_freed_with_its_entry(
    local: Local, providers: Providers
) -> None:
    part, episodes = local
    episodes.start(R0)
    episodes.start(R1)
    await episodes.at_boundary(R0, R1)
    records = await part.export(None)
    provider = providers.directory("fresh")
    fresh = participant(provider)
    await fresh.install(records)
    assert len(trees(provider)) == 2

    freed = await fresh.delete_restored([R0.next()])

    assert freed == ["r1-a1"]
    assert fresh.sandboxes.held() == [R0.next()]
    assert len(trees(provider)) == 1


async def test_a_stop_commit_frees_the_exported_sandboxes(local: Local) -> None:
    part, episodes = local
    episodes.start(R0)
    await episodes.at_boundary(R0)
    records = await part.export(None)
    await part.park_exported(records)
    assert part.sandboxes.held() == []
    assert trees(part.sandboxes.provider) == []
