"""A checkpoint root's history from storage alone: `ray-ckpt timeline DIR`
after the coordinator is gone, and `ray-ckpt report ROOT -o report.html`,
rendered by headless Chromium (its DOM's rows, and no console error)."""

from __future__ import annotations

import html.parser
import json
import pathlib
import shutil
import subprocess
import uuid

import pytest
from click.testing import CliRunner

from coordination.cli.commands import main
from coordination.engine.coordinator_core import CoordinatorCore
from coordination.engine.journal import Journal
from coordination.engine.order import Member
from coordination.engine.timeline import StorageHistory
from coordination.reach.hosts import HttpHost
from participants.fleet import FleetConfig
from participants.local import start_local_fleet
from ray_ckpt.control.client import ControlClient
from ray_ckpt.identity import EpisodeId
from tests.unit.coordination.coord_fleet import FAST

CHROMIUM = shutil.which("chromium")


async def _core(config: FleetConfig) -> tuple[CoordinatorCore, object]:
    fleet = await start_local_fleet(config)
    core = CoordinatorCore(journal=Journal(None), timeouts=FAST, history=StorageHistory())
    for kind, url in fleet.urls.items():
        client = ControlClient(url, token=config.token, limit=4, limit_per_host=4)
        core.register(HttpHost(Member(kind, config.server_name(kind)), client))
    return core, fleet


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Two checkpoints of the reference servers (real HTTP, real files), and a
    restore of the second into a fresh fleet; every coordinator closed."""
    import asyncio

    where = tmp_path_factory.mktemp("root")
    config = FleetConfig(token=f"tok-{uuid.uuid4().hex}")

    async def build() -> None:
        core, fleet = await _core(config)
        try:
            await core.checkpoint(str(where / "step-1"), [EpisodeId("r1")], trigger="periodic")
            await core.checkpoint(str(where / "step-2"), [EpisodeId("r1")], durability="async")
            await core.pending.settle()
        finally:
            await core.aclose()
            await fleet.stop()  # type: ignore[attr-defined]
        core, fleet = await _core(config)
        try:
            await core.restore(str(where / "step-2"), [EpisodeId("r1"), EpisodeId("r2")])
        finally:
            await core.aclose()
            await fleet.stop()  # type: ignore[attr-defined]

    asyncio.run(build())
    return where


def test_timeline_of_a_directory_reads_storage_with_no_coordinator(root: pathlib.Path) -> None:
    out = CliRunner().invoke(main, ["timeline", str(root / "step-1")])
    assert out.exit_code == 0, out.output
    assert "checkpoint ckpt-" in out.output
    assert "(periodic, sync, ok)" in out.output
    assert "environment/" in out.output
    assert "prepare" in out.output
    trace = root / "trace.json"
    out = CliRunner().invoke(main, ["timeline", str(root / "step-2"), "-o", str(trace), "--json"])
    assert out.exit_code == 0, out.output
    found = json.loads(out.output)
    assert found["timeline"]["durability"] == "async"
    assert found["timeline"]["total_bytes"] > 0  # known once durable
    [restore] = found["restores"]
    bias = restore["restart_bias"]
    totals = {o: sum(r[o] for r in bias["rows"]) for o in ("continued", "restarted", "lost")}
    # Nothing was in flight: r1 (in the checkpoint's scope) and r2 start over.
    assert totals == {"continued": 0, "restarted": 2, "lost": 0}
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {1, 2}  # the checkpoint and its restore
    # A root is not a checkpoint directory: said so, typed, non-zero.
    out = CliRunner().invoke(main, ["timeline", str(root)])
    assert out.exit_code != 0
    assert "no saved timeline" in out.output


class _Dom(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str | None]] = []
        self.rects = 0
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "tr":
            self.rows.append(a)
        if tag == "rect":
            self.rects += 1
        self.urls += [v for k, v in attrs if k in ("src", "href") and v and "://" in v]


def chromium(page: pathlib.Path) -> tuple[str, str]:
    """(the DOM as rendered, the console lines) of `page` in headless Chromium."""
    assert CHROMIUM is not None
    run = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    return run.stdout, console


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (.ci/run installs it)")
def test_the_report_renders_every_checkpoint_and_restore_without_a_console_error(
    root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    page = tmp_path / "report.html"
    out = CliRunner().invoke(main, ["report", str(root), "-o", str(page)])
    assert out.exit_code == 0, out.output
    assert "2 checkpoints (2 with a timeline), 1 restores" in out.output
    dom, console = chromium(page)
    assert console == []
    parsed = _Dom()
    parsed.feed(dom)
    checkpoints = [r["data-name"] for r in parsed.rows if r.get("class") == "checkpoint"]
    assert checkpoints == ["step-1", "step-2"]
    buckets = [r["data-bucket"] for r in parsed.rows if r.get("class") == "bias"]
    assert buckets == ["0", "1-2", "3-5", "6-10", "11+", "unknown"]
    participants = [r for r in parsed.rows if r.get("class") == "phases participant"]
    assert len(participants) == 2 * 4  # four servers in each checkpoint
    assert parsed.rects > 0  # the phases as bars
    assert parsed.urls == []  # nothing outside the page (links are #anchors)
    assert "http" not in page.read_text()


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (.ci/run installs it)")
def test_the_console_check_sees_an_error(tmp_path: pathlib.Path) -> None:
    page = tmp_path / "bad.html"
    page.write_text("<!doctype html><script>console.error('broken')</script>")
    _, console = chromium(page)
    assert any("broken" in line for line in console)
