"""The reference coding environment: each episode patches a small project in its sandbox.

`POST /run` `{"episode_id": {"rollout_id", "attempt"}, "task": {"task_id",
"seed", "steps", "background"?}}` runs one episode in a sandbox of its own
(`participants.sandboxes`, over the local `DirectorySandbox`) and answers
`{"episode_id", "task_id", "result"}` or `{..., "failure": {"code",
"detail"}}`, as the reference environment does.  No model is called: the
"agent" is a deterministic function of the seed and the step, so two runs of
one task leave equal files and equal rewards, and a continued run can be
compared with an uninterrupted one.  The steps, each a `wait` step (a
checkpoint never captures a sandbox mid-step) recording its boundary:

0. **setup**: create the sandbox and write the project: `calc.py`, a module
   of a few functions that all start out wrong, and `test_calc.py`, one
   unittest per function;
1. ... `steps`. **patch**: read `calc.py` back from the sandbox, rewrite one
   function (chosen by seed and step; the rewrite is right or another bug),
   append a line to `NOTES.md` (so a step run twice shows in the files),
   write a script `scripts/step_<i>.py` that calls every function and writes
   what they return to `out/step_<i>.txt`, and run it (`sys.executable`);
   with `"background": true`, step 1 also starts a background process that
   waits for a `stop-bg` file (at most `BACKGROUND_BOUND_S`) and then writes
   `bg.txt`: it is alive at every boundary until the last step, so a
   checkpoint reports that episode as a restart (a copy of files is not a
   copy of a running process);
2. **tests**: stop the background process (write `stop-bg`, wait for it),
   run `python -m unittest -v`, write the outcomes to `results.txt`; the
   reward is the fraction of tests that pass.  The result carries the
   outcomes, the reward and the digest of every file of the sandbox.

Then the episode's sandbox is freed.  A continuation (attempt + 1 after a
restore) goes on from its boundary in the restored sandbox.  `GET /stats`
adds the sandboxes held, those running a process (`processes_live`), each
live episode's next step (`progress`), the episodes a checkpoint would
restart and why (`sandbox_restarts`), and what captures copied.  The sandboxes live under
`root` (default: a fresh directory under the host's temp dir), one per
episode; `step_delay_s` holds each step open (the agent "thinking"), so a
checkpoint can land mid-flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import re
import sys
import tempfile
from collections import Counter
from typing import Any

import orjson
from aiohttp import web

from participants.common import ServerBase, guarded, json_object
from participants.environment import expect_task, task_digest
from participants.sandboxes import SandboxedEnvironment
from participants.servers.environment import parse_task
from ray_ckpt.control.wire import to_builtins
from ray_ckpt.errors import (
    CheckpointError,
    InvalidCheckpointState,
    InvalidRequest,
    SandboxRefused,
)
from ray_ckpt.identity import EpisodeId
from ray_ckpt.sandbox.directory import DirectorySandbox
from ray_ckpt.sandbox.provider import SandboxHandle, SandboxProvider
from ray_ckpt.settings import CheckpointSettings
from ray_ckpt.steps import Episode, EpisodeSteps
from ray_ckpt.steps.receipts import ResultReceipts

# A background process never outlives this, whoever forgets to stop it
# (a crashed host's process keeps running in its own process group).
BACKGROUND_BOUND_S = 30.0
MAX_PATCH_STEPS = 64
# No bytecode files: they embed timestamps, and every run must leave equal files.
PYTHON = (sys.executable, "-B")
SANDBOX_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
TEST_LINE = re.compile(r"^(test_\w+) \(.*\) \.\.\. (ok|FAIL|ERROR)\s*$", re.MULTILINE)

# The project: per function, its test, the wrong version it starts as, a
# right one and another wrong one (the "agent" may pick either).
FUNCTIONS: dict[str, dict[str, str]] = {
    "add": {
        "test": "self.assertEqual(calc.add(2, 3), 5)\n        self.assertEqual(calc.add(-4, 4), 0)",
        "start": "def add(a, b):\n    return a - b\n",
        "right": "def add(a, b):\n    return a + b\n",
        "wrong": "def add(a, b):\n    return a + b + 1\n",
    },
    "mul": {
        "test": "self.assertEqual(calc.mul(3, 4), 12)\n        self.assertEqual(calc.mul(0, 9), 0)",
        "start": "def mul(a, b):\n    return a + b\n",
        "right": "def mul(a, b):\n    return a * b\n",
        "wrong": "def mul(a, b):\n    return a * b + a\n",
    },
    "clamp": {
        "test": "self.assertEqual(calc.clamp(5, 0, 3), 3)\n"
        "        self.assertEqual(calc.clamp(-1, 0, 3), 0)\n"
        "        self.assertEqual(calc.clamp(2, 0, 3), 2)",
        "start": "def clamp(x, lo, hi):\n    return x\n",
        "right": "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
        "wrong": "def clamp(x, lo, hi):\n    return min(lo, max(x, hi))\n",
    },
    "fib": {
        "test": "self.assertEqual([calc.fib(n) for n in range(8)], [0, 1, 1, 2, 3, 5, 8, 13])",
        "start": "def fib(n):\n    return n\n",
        "right": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
        "    return a\n",
        "wrong": "def fib(n):\n    a, b = 1, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
        "    return a\n",
    },
    "palindrome": {
        "test": "self.assertTrue(calc.palindrome('Racecar'))\n"
        "        self.assertFalse(calc.palindrome('abca'))",
        "start": "def palindrome(s):\n    return s == s[::-1]\n",
        "right": "def palindrome(s):\n    s = s.lower()\n    return s == s[::-1]\n",
        "wrong": "def palindrome(s):\n    return s.lower() == s\n",
    },
    "words": {
        "test": "self.assertEqual(calc.words('a  b c'), 3)\n"
        "        self.assertEqual(calc.words(''), 0)",
        "start": "def words(s):\n    return len(s.split(' '))\n",
        "right": "def words(s):\n    return len(s.split())\n",
        "wrong": "def words(s):\n    return len(s.split()) or 1\n",
    },
}
SAMPLES = {
    "add": "(2, 3)",
    "mul": "(3, 4)",
    "clamp": "(5, 0, 3)",
    "fib": "(7,)",
    "palindrome": "('Racecar',)",
    "words": "('a  b c',)",
}

BACKGROUND = f"""\
import os, time
end = time.monotonic() + {BACKGROUND_BOUND_S}
while time.monotonic() < end and not os.path.exists("stop-bg"):
    os.getcwd()  # raises once the sandbox is removed: stop with it
    time.sleep(0.02)
with open("bg.txt", "w") as f:
    f.write("stopped\\n" if os.path.exists("stop-bg") else "timed out\\n")
"""

# Every file of the sandbox by its SHA-256: what two runs compare.
FILE_DIGESTS = """\
import hashlib, json, os
out = {}
for top, dirs, files in os.walk("."):
    dirs.sort()
    for name in files:
        path = os.path.relpath(os.path.join(top, name), ".").replace(os.sep, "/")
        with open(path, "rb") as f:
            out[path] = hashlib.sha256(f.read()).hexdigest()
print(json.dumps(out, sort_keys=True))
"""


class CommandFailed(SandboxRefused):
    """A command the episode ran in its sandbox failed: the episode's failure."""


def project_files() -> dict[str, str]:
    """The project as the setup step writes it: every function wrong."""
    calc = "".join(f"# == {name} ==\n{f['start']}" for name, f in FUNCTIONS.items())
    tests = "".join(
        f"    def test_{name}(self):\n        {f['test']}\n\n" for name, f in FUNCTIONS.items()
    )
    test_calc = f"import unittest\n\nimport calc\n\n\nclass CalcTests(unittest.TestCase):\n{tests}"
    return {
        "calc.py": calc,
        "test_calc.py": test_calc.rstrip() + "\n",
        "NOTES.md": "# what the agent did\n",
    }


def patch_of(seed: int, step: int) -> tuple[str, str]:
    """(function, "right" | "wrong"): the agent's edit at `step`, by seed alone."""
    rng = random.Random(f"coding/{seed}/{step}")
    name = rng.choice(sorted(FUNCTIONS))
    return name, "right" if rng.random() < 0.6 else "wrong"


def patched(source: str, name: str, version: str) -> str:
    """`calc.py` with one function's block replaced (a block per `# == name ==`)."""
    blocks = re.split(r"(?m)^(?=# == )", source)
    head = f"# == {name} ==\n"
    if not any(b.startswith(head) for b in blocks):
        raise InvalidCheckpointState(f"calc.py in the sandbox has no function {name!r}")
    return "".join(head + FUNCTIONS[name][version] if b.startswith(head) else b for b in blocks)


def step_script(step: int) -> str:
    calls = "".join(
        f"    try:\n        value = repr(calc.{n}(*{args}))\n"
        f"    except Exception as exc:\n        value = type(exc).__name__\n"
        f"    lines.append('{n}: ' + value)\n"
        for n, args in SAMPLES.items()
    )
    return (
        "import os, sys\nsys.path.insert(0, os.getcwd())\nimport calc\n\n\n"
        f"def main():\n    lines = []\n{calls}"
        f"    os.makedirs('out', exist_ok=True)\n"
        f"    with open('out/step_{step}.txt', 'w') as f:\n"
        "        f.write('\\n'.join(lines) + '\\n')\n"
        "    print(len(lines))\n\n\nmain()\n"
    )


def parse_task_options(task: dict[str, Any]) -> bool:
    """`background`: absent, or a boolean (a string must not mean yes)."""
    value = task.get("background", False)
    if not isinstance(value, bool):
        raise InvalidRequest(f"'background' must be a boolean, got {value!r}")
    if task["steps"] > MAX_PATCH_STEPS:
        raise InvalidRequest(f"'steps' must be at most {MAX_PATCH_STEPS}, got {task['steps']}")
    return value


def files_digest(files: dict[str, str]) -> str:
    return hashlib.sha256(orjson.dumps(files, option=orjson.OPT_SORT_KEYS)).hexdigest()


class CodingServer(ServerBase):
    kind = "environment"

    def __init__(
        self,
        name: str,
        *,
        provider: SandboxProvider,
        step_delay_s: float = 0.0,
        command_timeout_s: float = 60.0,
        receipts: ResultReceipts | None = None,
    ) -> None:
        super().__init__(name)
        self.steps = EpisodeSteps()
        self.participant = SandboxedEnvironment(self.steps, provider, receipts)
        self.provider = provider
        self.step_delay_s = step_delay_s
        self.command_timeout_s = command_timeout_s
        self.counters: Counter[str] = Counter()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/run", guarded(self.run))
        app.router.add_get("/stats", self.stats_route)
        return app

    async def run(self, request: web.Request) -> web.Response:
        self.calls["run"] += 1
        episode, task = parse_task(await json_object(request))
        background = parse_task_options(task)
        self.check_attempt(episode)
        self.participant.refuse_finished(episode)
        ep = self.steps.begin(
            episode,
            boundary={"next": 0, "task_digest": task_digest(task)},
            expect=expect_task(task),
        )
        reply: dict[str, Any] = {
            "episode_id": {"rollout_id": episode.rollout_id, "attempt": episode.attempt},
            "task_id": task["task_id"],
        }
        try:
            async with ep:
                reply["result"] = await self.drive(ep, task, background)
        except CheckpointError as exc:
            self.counters["failures"] += 1
            reply["failure"] = exc.to_body()["error"]
            await self.participant.release(episode)
            return web.json_response(reply)
        await self.participant.release(episode)
        receipt = self.participant.hold(episode, reply["result"])
        if receipt is not None:
            reply["receipt"] = to_builtins(receipt)
        return web.json_response(reply)

    # --- one episode ----------------------------------------------------------------

    async def drive(self, ep: Episode, task: dict[str, Any], background: bool) -> dict[str, Any]:
        """Run (or continue from its restored boundary) one episode to its result."""
        d = task_digest(task)
        ep.claim()  # a restored boundary, handed over once; it is the episode's boundary
        state: dict[str, Any] = ep.boundary_state
        if state.get("task_digest") != d:
            raise InvalidRequest(f"episode {ep.id} was restored for a different task")
        last = task["steps"] + 1  # the tests' step
        while state["next"] != "return":
            index = int(state["next"])
            async with ep.step("wait", name=f"step-{index}") as st:
                if self.step_delay_s:
                    await asyncio.sleep(self.step_delay_s)
                if index == 0:
                    await self.setup(ep.id)
                    state = {"next": 1, "task_digest": d, "outputs": []}
                elif index < last:
                    printed = await self.patch(ep.id, task, index, background)
                    state = {**state, "next": index + 1, "outputs": [*state["outputs"], printed]}
                else:
                    result = await self.test(ep.id, task, background, state["outputs"])
                    state = {"next": "return", "task_digest": d, "result": result}
                st.boundary(state)
            self.counters["steps"] += 1
        return dict(state["result"])

    def sandbox(self, episode: EpisodeId) -> SandboxHandle:
        handle = self.participant.sandboxes.handle(episode)
        if handle is None:
            raise InvalidCheckpointState(f"episode {episode} has no sandbox here")
        return handle

    async def setup(self, episode: EpisodeId) -> None:
        handle = await self.participant.sandboxes.create(episode, env=SANDBOX_ENV)
        for path, text in project_files().items():
            await self.provider.write_file(handle, path, text.encode())
        self.counters["sandboxes_created"] += 1

    async def patch(
        self, episode: EpisodeId, task: dict[str, Any], index: int, background: bool
    ) -> str:
        handle = self.sandbox(episode)
        name, version = patch_of(task["seed"], index)
        source = (await self.provider.read_file(handle, "calc.py")).decode()
        await self.provider.write_file(handle, "calc.py", patched(source, name, version).encode())
        # The agent's notes grow step by step: a step run twice, or on files
        # a later step already changed, shows in them.
        notes = await self.provider.read_file(handle, "NOTES.md")
        line = f"- step {index}: {name} ({version})\n".encode()
        await self.provider.write_file(handle, "NOTES.md", notes + line)
        script = f"scripts/step_{index}.py"
        await self.provider.write_file(handle, script, step_script(index).encode())
        if background and index == 1:
            started = await self.provider.run(
                handle, [*PYTHON, "-c", BACKGROUND], timeout_s=BACKGROUND_BOUND_S, background=True
            )
            if started.pid is None:
                raise CommandFailed(f"episode {episode}: the background process did not start")
            self.counters["background_started"] += 1
        ran = await self.provider.run(handle, [*PYTHON, script], timeout_s=self.command_timeout_s)
        if ran.exit_code != 0:
            raise CommandFailed(
                f"episode {episode}: {script} failed ({ran.exit_code}): {ran.stderr[-400:]}"
            )
        return f"{name}:{version}:{ran.stdout.strip()}"

    async def test(
        self, episode: EpisodeId, task: dict[str, Any], background: bool, outputs: list[str]
    ) -> dict[str, Any]:
        handle = self.sandbox(episode)
        if background:
            await self.provider.write_file(handle, "stop-bg", b"stop\n")
            await self.wait_quiet(episode, handle)
        ran = await self.provider.run(
            handle, [*PYTHON, "-m", "unittest", "-v"], timeout_s=self.command_timeout_s
        )
        outcomes = dict(TEST_LINE.findall(ran.stderr))
        if len(outcomes) != len(FUNCTIONS):
            raise CommandFailed(
                f"episode {episode}: the tests did not run ({ran.exit_code}): {ran.stderr[-400:]}"
            )
        lines = "".join(f"{name}: {outcome}\n" for name, outcome in sorted(outcomes.items()))
        await self.provider.write_file(handle, "results.txt", lines.encode())
        listed = await self.provider.run(
            handle, [*PYTHON, "-c", FILE_DIGESTS], timeout_s=self.command_timeout_s
        )
        files: dict[str, str] = orjson.loads(listed.stdout)
        passed = sum(1 for o in outcomes.values() if o == "ok")
        return {
            "task_id": task["task_id"],
            "reward": passed / len(outcomes),
            "tests": dict(sorted(outcomes.items())),
            "outputs": outputs,
            "files": files,
            "files_digest": files_digest(files),
        }

    async def wait_quiet(self, episode: EpisodeId, handle: SandboxHandle) -> None:
        """Until no process of the sandbox runs (the background one saw `stop-bg`)."""
        async with asyncio.timeout(BACKGROUND_BOUND_S + 5.0):
            while self.provider.alive(handle):  # noqa: ASYNC110 - the provider has no wait
                await asyncio.sleep(0.02)

    def stats(self) -> dict[str, Any]:
        sandboxes = self.participant.sandboxes
        return {
            **self.base_stats(),
            **dict(self.counters),
            "live_episodes": self.steps.live_executions(),
            "restored_episodes": len(self.steps.restored_ids()),
            "sandboxes": len(sandboxes.held()),
            # Whose sandbox runs a process now, and each live episode's next step.
            "processes_live": sorted(
                eid.capture_key
                for eid in sandboxes.held()
                if (h := sandboxes.handle(eid)) is not None and self.provider.alive(h)
            ),
            "progress": {ep.key: ep.boundary_state.get("next") for ep in self.steps.episodes()},
            "sandbox_restarts": self.participant.restart_reasons(),
            "sandbox_captures": sandboxes.captures,
            "sandbox_copied_bytes": sandboxes.copied_bytes,
            "unacknowledged_results": len(self.participant.receipts or ()),
        }

    async def aclose(self) -> None:
        # A graceful stop: no episode runs any more; their sandboxes go.
        with contextlib.suppress(CheckpointError):
            await self.participant.sandboxes.drop(self.participant.sandboxes.held())
        close = getattr(self.provider, "close", None)  # beyond the contract: the root's lock
        if close is not None:
            await close()
        await super().aclose()


def coding_server(
    *,
    name: str,
    settings: CheckpointSettings,
    root: str | None = None,
    step_delay_s: float = 0.0,
    command_timeout_s: float = 60.0,
) -> CodingServer:
    """The `ServerSpec` factory (`participants.servers.coding:coding_server`)."""
    receipts = None
    if settings.enabled and settings.completion_receipts:
        receipts = ResultReceipts(
            max_results=settings.max_unacknowledged_results,
            max_bytes=settings.max_unacknowledged_bytes,
        )
    provider = DirectorySandbox(root or tempfile.mkdtemp(prefix="ray-ckpt-sandboxes-"))
    return CodingServer(
        name,
        provider=provider,
        step_delay_s=step_delay_s,
        command_timeout_s=command_timeout_s,
        receipts=receipts,
    )
