"""What every `ray-ckpt` command shares: the cluster options, JSON out, errors.

A refusal prints `error: <code>: <detail>` on stderr (or, with `--json`, the
wire's error body on stdout) and exits 1.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click
import msgspec

from coordination.engine.results import LastCheckpoint, PeriodicStatus
from ray_ckpt.errors import CheckpointError, CoordinationFailed

F = TypeVar("F", bound=Callable[..., Any])


def json_option(fn: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(
        fn
    )


def cluster_options(fn: F) -> F:
    fn = json_option(fn)
    fn = click.option("--namespace", default="ray-ckpt", show_default=True, help="Ray namespace.")(
        fn
    )
    fn = click.option(
        "--address", default="auto", show_default=True, help='Ray address ("auto" attaches).'
    )(fn)
    return fn


def emit(value: Any) -> None:
    click.echo(msgspec.json.encode(value).decode())


def fail(exc: CheckpointError, as_json: bool) -> NoReturn:
    if as_json:
        emit(exc.to_body())
    else:
        click.echo(f"error: {exc}", err=True)
        if isinstance(exc, CoordinationFailed):
            for who, why in sorted(exc.failures.items()):
                click.echo(f"  {who}: {why.get('code')}: {why.get('detail')}", err=True)
    sys.exit(1)


def lease_left(expires_at: float | None, now: float) -> str:
    """Seconds until a participant's lease lapses ("-": none held)."""
    if expires_at is None:
        return "-"
    left = expires_at - now
    return f"{left:.0f}s" if left > 0 else "lapsed"


def last_checkpoint_line(last: LastCheckpoint | None, now: float) -> str:
    if last is None:
        return "last checkpoint: none by this coordinator"
    return (
        f"last checkpoint: {last.checkpoint_id} ({last.trigger}) "
        f"{max(now - last.finished_at, 0):.0f}s ago, took {last.total_s:.3f}s, "
        f"{'size pending' if last.bytes is None else size(last.bytes)}, in {last.checkpoint_dir}"
    )


def utc_time(ts: float) -> str:
    """A full UTC date and time (listings: checkpoints days apart)."""
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"


def periodic_line(p: PeriodicStatus) -> str:
    """`status`'s line about the periodic loop: counts and the last error."""
    state = f"every {p.every_s:g}s" if p.running else "stopped"
    keep = f", keep {p.keep_latest_k}" if p.keep_latest_k is not None else ""
    line = (
        f"periodic {state} under {p.root}{keep}: {p.completed} done, {p.failed} failed"
        f" of {p.attempts}, {p.deleted} deleted"
    )
    if p.last_error is not None:
        line += f"; last error ({p.last_error.get('name')}): {p.last_error.get('code')}: "
        line += str(p.last_error.get("detail"))[:200]
    return line
