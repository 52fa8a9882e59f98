"""What every `ray-ckpt` command shares: the cluster options, JSON out, errors,
and the one byte formatter.

Errors.  Every refusal is ONE line on stderr, `error (<class>): <what went
wrong>; <what to do>`, and the process exits with the code of its class
(`ExitCode`, mapped from `ray_ckpt.errors.Reason` in `EXIT_BY_REASON`): a
script can branch on the code, a person reads the line.  With `--json` the
wire's error body (`{"error": {"code", "detail", ...}}`) also goes to
stdout.  No traceback and no Python warning reaches the user: the group
(`RayCkptGroup`) turns every exception into such a line; `ray-ckpt --debug
CMD` (or `RAY_CKPT_DEBUG=1`) prints the traceback too.
"""

from __future__ import annotations

import datetime
import enum
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click
import msgspec

from coordination.engine.results import LastCheckpoint, PeriodicStatus
from ray_ckpt.errors import CheckpointError, CoordinationFailed, Reason


class ExitCode(enum.IntEnum):
    """The exit status of every `ray-ckpt` command, one per class of error."""

    OK = 0
    # The command ran and its answer is "no": `inspect` found the checkpoint
    # invalid, the demo's results differ; also an error nobody classified.
    FAILED = 1
    BAD_INPUT = 2  # an argument, option, file or body is wrong: fix the command
    NOT_FOUND = 3  # a path, checkpoint, receipt or coordinator is not there
    CONFLICT = 4  # the Gym's state refuses it now (phase, fencing, live fleet)
    UNAVAILABLE = 5  # Ray, the store or a participant does not answer: retry later

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", " ")


EXIT_BY_REASON: dict[Reason, ExitCode] = {
    Reason.UNAUTHORIZED: ExitCode.BAD_INPUT,
    Reason.INVALID_REQUEST: ExitCode.BAD_INPUT,
    Reason.PAYLOAD_TOO_LARGE: ExitCode.BAD_INPUT,
    Reason.METHOD_NOT_ALLOWED: ExitCode.BAD_INPUT,
    Reason.ROLLOUT_ID_REQUIRED: ExitCode.BAD_INPUT,
    Reason.NOT_FOUND: ExitCode.NOT_FOUND,
    Reason.UNKNOWN_RECEIPT: ExitCode.NOT_FOUND,
    # No usable checkpoint there (missing, never published, damaged).
    Reason.INVALID_CHECKPOINT_STATE: ExitCode.NOT_FOUND,
    Reason.STALE_CHECKPOINT: ExitCode.CONFLICT,
    Reason.CHECKPOINT_CONFLICT: ExitCode.CONFLICT,
    Reason.INVALID_PHASE: ExitCode.CONFLICT,
    Reason.STALE_ATTEMPT: ExitCode.CONFLICT,
    Reason.ADMISSION_CLOSED: ExitCode.CONFLICT,
    Reason.RESTART_IN_SCOPE: ExitCode.CONFLICT,
    Reason.FINISHED_IN_SCOPE: ExitCode.CONFLICT,
    Reason.RECEIPTS_OFF: ExitCode.CONFLICT,
    Reason.RESULT_HELD: ExitCode.CONFLICT,
    Reason.MEMBERSHIP_CHANGED: ExitCode.CONFLICT,
    Reason.NOT_FRESH: ExitCode.CONFLICT,
    Reason.RESTORED_STATE_LOST: ExitCode.CONFLICT,
    Reason.STALE_COORDINATOR: ExitCode.CONFLICT,
    Reason.SANDBOX_FENCED: ExitCode.CONFLICT,
    Reason.SANDBOX_REFUSED: ExitCode.BAD_INPUT,
    Reason.DEADLINE_EXCEEDED: ExitCode.UNAVAILABLE,
    Reason.PARTICIPANT_UNAVAILABLE: ExitCode.UNAVAILABLE,
    Reason.COORDINATION_FAILED: ExitCode.UNAVAILABLE,
}

# What to do, per class (a reason's own hint in `REASON_HINTS` wins).
HINTS: dict[ExitCode, str] = {
    ExitCode.FAILED: "rerun with `ray-ckpt --debug ...` for the traceback",
    ExitCode.BAD_INPUT: "fix the command (`ray-ckpt COMMAND --help`)",
    ExitCode.NOT_FOUND: "check the location, the ID and --namespace",
    ExitCode.CONFLICT: "run `ray-ckpt status` to see the Gym's state, then retry",
    ExitCode.UNAVAILABLE: "check that Ray and the Gym servers run (`ray-ckpt status`), then retry",
}
REASON_HINTS: dict[Reason, str] = {
    Reason.INVALID_CHECKPOINT_STATE: "check the directory with `ray-ckpt inspect DIR` "
    "(a root of checkpoints: `ray-ckpt list ROOT`, or `restore ROOT --latest`)",
    Reason.NOT_FRESH: "restore into a fresh Gym: `ray-ckpt restore DIR --relaunch` "
    "replaces the registered hosts first",
    Reason.RESTART_IN_SCOPE: "drop --strict, or leave those episodes out of --scope",
    Reason.UNKNOWN_RECEIPT: "list the held results with `ray-ckpt collect --json`",
    Reason.RESULT_HELD: "collect and ack the held result (`ray-ckpt collect`, `ray-ckpt ack`)",
    Reason.INVALID_PHASE: "a checkpoint is open: `ray-ckpt resume` ends it",
    Reason.CHECKPOINT_CONFLICT: "a checkpoint is open: `ray-ckpt resume` ends it",
}
S3_HINT = (
    "set AWS_ENDPOINT_URL (and AWS_ALLOW_HTTP=true for http://), AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY; actors on a running cluster get them through "
    "runtime_env (docs/operations/cli.md)"
)


class CliError(Exception):
    """A refusal the command line makes itself (no Ray, a wrong kind of
    directory, ...): its class, what went wrong and what to do."""

    def __init__(
        self, detail: str, exit_code: ExitCode, *, hint: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.exit_code = exit_code
        self.hint = hint
        self.code = code or exit_code.name.lower()

    def to_body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "detail": self.detail}}


def exit_code_of(exc: BaseException) -> ExitCode:
    """The class of any exception a command may meet."""
    if isinstance(exc, CliError):
        return exc.exit_code
    if isinstance(exc, CoordinationFailed):
        # Every participant refused for one class of reason: that class.
        classes = {
            EXIT_BY_REASON.get(_reason(str(why.get("code"))), ExitCode.UNAVAILABLE)
            for why in exc.failures.values()
        }
        return classes.pop() if len(classes) == 1 else ExitCode.UNAVAILABLE
    if isinstance(exc, CheckpointError):
        return EXIT_BY_REASON.get(exc.reason) or _by_http_status(exc.reason.http_status)
    if isinstance(exc, click.FileError | FileNotFoundError):
        return ExitCode.NOT_FOUND
    if isinstance(exc, click.ClickException):
        return ExitCode.BAD_INPUT
    if isinstance(exc, PermissionError | IsADirectoryError | NotADirectoryError | ValueError):
        return ExitCode.BAD_INPUT
    if isinstance(exc, ConnectionError | TimeoutError) or _is_ray_unavailable(exc):
        return ExitCode.UNAVAILABLE
    return ExitCode.FAILED


def _by_http_status(status: int) -> ExitCode:
    """A reason added after this table: its class from its HTTP status."""
    if status in (404, 422):
        return ExitCode.NOT_FOUND
    if status == 409:
        return ExitCode.CONFLICT
    return ExitCode.UNAVAILABLE if status >= 500 else ExitCode.BAD_INPUT


def _reason(code: str) -> Reason:
    try:
        return Reason(code)
    except ValueError:
        return Reason.COORDINATION_FAILED  # a code we do not know: unavailable


def _is_ray_unavailable(exc: BaseException) -> bool:
    """Ray's own errors for a cluster, actor or call that is gone or late."""
    module = type(exc).__module__
    return module.startswith("ray.") and type(exc).__name__ in {
        "RaySystemError",
        "RayActorError",
        "ActorDiedError",
        "ActorUnavailableError",
        "GetTimeoutError",
        "NodeDiedError",
        "ObjectLostError",
        "OwnerDiedError",
    }


def one_line(text: str, limit: int = 600) -> str:
    """Any text as one line: a message that spans lines (a remote error's)
    keeps its first part; nothing long enough to wrap a terminal many times."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def error_line(exc: BaseException) -> str:
    """`error (<class>): <what went wrong>; <what to do>`: one line."""
    code = exit_code_of(exc)
    if isinstance(exc, CliError | CheckpointError):
        what = one_line(exc.detail)
    elif isinstance(exc, click.ClickException):
        what = one_line(exc.format_message())
    elif code is ExitCode.FAILED:
        what = one_line(f"unexpected {type(exc).__name__}: {exc}")
    else:
        what = one_line(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, CoordinationFailed) and exc.failures:
        parts = [
            f"{who}: {why.get('code')}: {why.get('detail')}"
            for who, why in sorted(exc.failures.items())
        ]
        what = one_line(f"{what} ({'; '.join(parts)})")
    return f"error ({code.label}): {what}; {_hint(exc, code)}"


def _hint(exc: BaseException, code: ExitCode) -> str:
    if isinstance(exc, CliError) and exc.hint:
        return exc.hint
    if isinstance(exc, CheckpointError):
        if "s3://" in exc.detail and code is not ExitCode.CONFLICT:
            return S3_HINT
        if exc.reason in REASON_HINTS:
            return REASON_HINTS[exc.reason]
    return HINTS.get(code, HINTS[ExitCode.FAILED])


def debugging() -> bool:
    """`ray-ckpt --debug` (or RAY_CKPT_DEBUG=1): tracebacks and warnings shown."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.find_root().meta.get("ray_ckpt.debug"):
        return True
    return os.environ.get("RAY_CKPT_DEBUG", "") not in ("", "0")


def report_error(exc: BaseException, *, as_json: bool = False, debug: bool = False) -> ExitCode:
    """Print `exc` as the one error line (and, with `--json`, the wire body on
    stdout); the exit code.  `debug`: the traceback first."""
    code = exit_code_of(exc)
    if debug and exc.__traceback__ is not None:
        traceback.print_exception(exc, file=sys.stderr)
    if as_json:
        body = exc.to_body() if isinstance(exc, CliError | CheckpointError) else None
        body = body or {"error": {"code": code.name.lower(), "detail": one_line(str(exc))}}
        body["error"]["exit_code"] = int(code)
        emit(body)
    click.echo(error_line(exc), err=True)
    return code


F = TypeVar("F", bound=Callable[..., Any])


def _remember_json(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    # The group's error handler prints the JSON body too when asked for.
    ctx.find_root().meta["ray_ckpt.as_json"] = value
    return value


def json_option(fn: F) -> F:
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        callback=_remember_json,
        help="Print JSON instead of a table.",
    )(fn)


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


def fail(exc: BaseException, as_json: bool) -> NoReturn:
    """Refuse: the one error line (and the JSON body with `--json`), exit per class."""
    sys.exit(int(report_error(exc, as_json=as_json, debug=debugging())))


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
        f"{'size pending' if last.bytes is None else format_bytes(last.bytes)}, "
        f"in {last.checkpoint_dir}"
    )


def utc_time(ts: float) -> str:
    """A full UTC date and time (listings: checkpoints days apart)."""
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def format_bytes(n: int | None) -> str:
    """THE byte count for people, in every command and the demo: IEC units
    (1 KiB = 1024 B), one decimal above bytes."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} TiB"


size = format_bytes


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


class RayCkptGroup(click.Group):
    """The `ray-ckpt` group: every error of every command is one line.

    Click's own usage errors (a missing argument, a bad option value) and
    anything a command raises are printed by `report_error` and exit with
    their class's code; warnings are held back (our own `UserWarning`s are
    shown as one `note:` line each) unless `--debug`."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        debug = os.environ.get("RAY_CKPT_DEBUG", "") not in ("", "0")
        argv = kwargs.get("args") if "args" in kwargs else (args[0] if args else None)
        debug = debug or "--debug" in (sys.argv[1:] if argv is None else list(argv))[:1]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default" if debug else "always")
            try:
                rv = super().main(*args, standalone_mode=False, **kwargs)  # type: ignore[call-overload]
            except click.exceptions.Exit as exc:
                rv = exc.exit_code
            except click.Abort:
                click.echo("error (failed): aborted", err=True)
                rv = int(ExitCode.FAILED)
            except SystemExit as exc:
                rv = exc.code
            except Exception as exc:
                rv = int(report_error(exc, as_json=_as_json(exc), debug=debug))
            finally:
                _show_notes(caught, debug)
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0 if rv is None else 1)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.Abort, SystemExit):
            raise
        except click.ClickException as exc:
            raise SystemExit(int(report_error(exc, debug=debugging()))) from None
        except Exception as exc:
            as_json = bool(ctx.meta.get("ray_ckpt.as_json"))
            raise SystemExit(int(report_error(exc, as_json=as_json, debug=debugging()))) from None


def _as_json(_exc: BaseException) -> bool:
    return False  # before a command parsed its options: no --json yet


def _show_notes(caught: list[warnings.WarningMessage], debug: bool) -> None:
    for w in caught:
        if debug:
            click.echo(
                warnings.formatwarning(w.message, w.category, w.filename, w.lineno), err=True
            )
        elif issubclass(w.category, UserWarning) and _ours(w.filename):
            click.echo(f"note: {one_line(str(w.message))}", err=True)


def _ours(filename: str) -> bool:
    return any(f"{os.sep}{pkg}{os.sep}" in filename for pkg in ("coordination", "ray_ckpt"))
