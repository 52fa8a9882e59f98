"""Commands: each in a process group of its own, killed whole at its timeout;
the provider knows whether any process of a sandbox still runs."""

from __future__ import annotations

import asyncio
import os
import pathlib
import time

from ray_ckpt.sandbox import DirectorySandbox
from ray_ckpt.sandbox import groups as process_groups
from tests.unit.helpers import until


def _running(pid: int) -> bool:
    """Not gone and not a zombie (an orphan waits for init to reap it)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: reaped between open and read
        return False
    return stat[stat.rfind(b")") + 2 :].split()[0] not in (b"Z", b"X")


async def test_a_timeout_kills_the_whole_group(provider: DirectorySandbox) -> None:
    h = await provider.create("r1")
    t0 = time.monotonic()
    result = await provider.run(h, ["sh", "-c", "sleep 30 & echo $!; sleep 30"], timeout_s=0.5)
    assert time.monotonic() - t0 < 10
    assert result.timed_out is True
    assert result.exit_code == -9
    assert result.pid is not None
    child = int(result.stdout.split()[0])  # output read before the kill is kept
    await until(lambda: not _running(child) and not _running(result.pid or 0), timeout=5)
    assert not process_groups.alive(result.pid)
    assert provider.alive(h) is False


async def test_alive_with_a_background_process_and_not_after_it_exits(
    provider: DirectorySandbox,
) -> None:
    h = await provider.create("r1")
    assert provider.alive(h) is False
    bg = await provider.run(h, ["sleep", "0.5"], timeout_s=30, background=True)
    assert (bg.exit_code, bg.pid) == (None, bg.pid)
    assert bg.pid is not None
    assert _running(bg.pid)
    assert provider.alive(h) is True
    await until(lambda: not provider.alive(h), timeout=10)
    assert not _running(bg.pid)


async def test_a_child_left_by_a_finished_command_keeps_the_sandbox_alive(
    provider: DirectorySandbox,
) -> None:
    """The command exits at once; the child it left (output redirected, so it
    holds none of the command's pipes) runs on in the command's group."""
    h = await provider.create("r1")
    result = await provider.run(h, ["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"], timeout_s=10)
    assert (result.exit_code, result.timed_out) == (0, False)
    child = int(result.stdout)
    assert _running(child)
    assert provider.alive(h) is True
    await provider.free(h)  # kills it before it returns
    assert not _running(child)
    assert provider.alive(h) is False


async def test_a_background_command_is_killed_at_its_deadline(
    provider: DirectorySandbox,
) -> None:
    h = await provider.create("r1")
    bg = await provider.run(h, ["sh", "-c", "sleep 30 & sleep 30"], timeout_s=0.3, background=True)
    assert provider.alive(h) is True
    await until(lambda: not provider.alive(h), timeout=10)
    assert bg.pid is not None
    assert not process_groups.alive(bg.pid)


async def test_a_cancelled_command_is_killed(provider: DirectorySandbox) -> None:
    h = await provider.create("r1")
    marker = provider.directory(h) / "pid"
    task = asyncio.create_task(
        provider.run(h, ["sh", "-c", "echo $$ > pid; exec sleep 30"], timeout_s=60)
    )
    await until(lambda: marker.exists() and marker.read_text().strip(), timeout=10)
    pid = int(marker.read_text())
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await until(lambda: not _running(pid), timeout=5)


async def test_commands_run_in_the_working_directory_with_only_the_sandbox_env(
    provider: DirectorySandbox,
) -> None:
    os.environ["RAY_CKPT_SANDBOX_TEST_LEAK"] = "1"
    try:
        h = await provider.create("r1", cwd="src/pkg")
        result = await provider.run(h, ["sh", "-c", "pwd; env"], timeout_s=10)
    finally:
        del os.environ["RAY_CKPT_SANDBOX_TEST_LEAK"]
    lines = result.stdout.splitlines()
    assert lines[0] == str((provider.directory(h) / "src" / "pkg").resolve())
    assert "RAY_CKPT_SANDBOX_TEST_LEAK=1" not in lines
    assert "PATH=/usr/local/bin:/usr/bin:/bin" in lines
