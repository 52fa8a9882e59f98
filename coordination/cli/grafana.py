"""`ray-ckpt grafana-dashboard`: the Grafana dashboard of ray-ckpt's metrics, as JSON.

`ray-ckpt grafana-dashboard > dashboard.json`, then import it in Grafana
(Dashboards, New, Import) or drop it in a provisioning folder beside Ray's
own dashboards; it reads the Prometheus data source Ray's metrics go to
(`coordination.actor.grafana_dashboard`).  Needs no cluster.
"""

from __future__ import annotations

import json

import click

from coordination.actor.grafana_dashboard import UID, dashboard


@click.command("grafana-dashboard")
@click.option(
    "--uid",
    default=UID,
    show_default=True,
    help="The dashboard's Grafana uid (another one to keep two versions side by side).",
)
def grafana_dashboard(uid: str) -> None:
    """Print the Grafana dashboard (JSON) of the checkpoint metrics."""
    board = dashboard()
    board["uid"] = uid
    click.echo(json.dumps(board, indent=2))
