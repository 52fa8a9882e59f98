"""`ray-ckpt schema`: the control routes' JSON Schema, generated from the wire types.

Needs no cluster: the schema is a property of the installed version
(`ray_ckpt.control.schema`).  Prints one JSON document with every route's
request, reply and error schema; `--route NAME` prints one route's, with
only the definitions it uses.
"""

from __future__ import annotations

import json

import click

from ray_ckpt.control.schema import ROUTES, document, route_schema


@click.command()
@click.option(
    "--route",
    type=click.Choice(list(ROUTES)),
    default=None,
    help="Only this route's request and reply schema.",
)
def schema(route: str | None) -> None:
    """JSON Schema of the control routes' requests and replies."""
    doc = document() if route is None else route_schema(route)
    click.echo(json.dumps(doc, indent=2))
