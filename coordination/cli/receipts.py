"""`ray-ckpt collect` and `ray-ckpt ack`: completion receipts from a shell.

`collect` lists every finished, unacknowledged result the environment
participants hold (`--json`: the results themselves, with their receipts);
`ack` acknowledges receipts read from a file or stdin, so a script can hand
results over exactly once: `ray-ckpt collect --json > held.json`, store them,
then `ray-ckpt ack held.json`.  `ack` takes a list of receipts, an object with
`receipts`, or `collect --json`'s own output (its `results`); an unknown
receipt refuses the whole call and acknowledges nothing.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import click
import msgspec

from coordination.cli.ops import connect_cli
from coordination.cli.output import cluster_options, emit, fail
from ray_ckpt.errors import CheckpointError, InvalidRequest, NotFound


@click.command()
@cluster_options
def collect(address: str, namespace: str, as_json: bool) -> None:
    """Every finished result still waiting for the trainer's acknowledgement."""
    from rich.console import Console
    from rich.table import Table

    try:
        res = connect_cli(address, namespace).collect()
    except CheckpointError as exc:
        fail(exc, as_json)
    if as_json:
        emit(res)
        return
    table = Table(title=f"{len(res.results)} results held for acknowledgement")
    for col in ("participant", "rollout", "attempt", "digest", "bytes"):
        table.add_column(col)
    for item in res.results:
        r = item.receipt
        size = len(msgspec.json.encode(item.result))
        table.add_row(item.participant, r.rollout_id, str(r.attempt), r.digest[:16], f"{size:,}")
    Console().print(table)


def _read(source: str) -> bytes:
    """FILE's bytes, or stdin's for "-"; a missing file is `NotFound`."""
    if source == "-":
        return sys.stdin.buffer.read()
    path = pathlib.Path(source)
    if not path.is_file():
        raise NotFound(f"receipts file {source} does not exist")
    return path.read_bytes()


def receipts_in(document: Any) -> list[Any]:
    """The receipts a document names: a list of them, `{"receipts": [...]}`,
    or `collect --json`'s `{"results": [{"receipt": ...}, ...]}`."""
    if isinstance(document, dict):
        if isinstance(document.get("receipts"), list):
            return list(document["receipts"])
        results = document.get("results")
        if isinstance(results, list):
            return [r.get("receipt") if isinstance(r, dict) else r for r in results]
    if isinstance(document, list):
        return document
    raise InvalidRequest(
        "expected a list of receipts, an object with 'receipts', or collect --json's output"
    )


@click.command()
@click.argument("source", default="-", metavar="[FILE|-]")
@cluster_options
def ack(source: str, address: str, namespace: str, as_json: bool) -> None:
    """Acknowledge the receipts in FILE (default stdin): their results are freed everywhere."""
    try:
        data = _read(source)
        if not data.strip():
            where = "stdin" if source == "-" else source
            raise InvalidRequest(
                f"no receipts to acknowledge: {where} is empty (pipe `ray-ckpt collect --json` in)"
            )
        try:
            document = msgspec.json.decode(data)
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"not JSON: {exc}") from None
        receipts = receipts_in(document)
        if not receipts:
            raise InvalidRequest("no receipts to acknowledge")
        res = connect_cli(address, namespace).ack(receipts)
    except CheckpointError as exc:
        fail(exc, as_json)
    if as_json:
        emit(res)
        return
    freed = sum(len(v) for v in res.acknowledged.values())
    click.echo(f"acknowledged {freed} results ({len(res.already)} already) in {res.seconds:.3f}s")
