"""The Grafana dashboard's shape (`ray-ckpt grafana-dashboard`); that its
queries read metrics Ray really exports is tests/ray/test_grafana_dashboard.py."""

from __future__ import annotations

import json

from click.testing import CliRunner

from coordination.actor.grafana_dashboard import UID, dashboard, metric_names, queries
from coordination.cli.commands import main


def test_the_command_prints_the_dashboard_and_takes_another_uid() -> None:
    runner = CliRunner()
    out = runner.invoke(main, ["grafana-dashboard"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == dashboard()
    other = json.loads(runner.invoke(main, ["grafana-dashboard", "--uid", "ckpt-v2"]).output)
    assert (dashboard()["uid"], other["uid"]) == (UID, "ckpt-v2")


def test_every_panel_queries_ray_ckpt_metrics_through_rays_filters() -> None:
    board = dashboard()
    graphs = [p for p in board["panels"] if p["type"] == "graph"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "SessionName", "Cluster"} <= names
    for panel in graphs:
        assert panel["datasource"] == "${datasource}"
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert metric_names(expr), expr
            # Every selector of the query, not only the first, is filtered.
            selectors = expr.count("{")
            assert expr.count('SessionName=~"$SessionName"') == selectors, expr
            assert expr.count('ray_io_cluster=~"$Cluster"') == selectors, expr
    # The panels the issue names are there: duration, pause, bytes, held
    # results, restores and the restart bias.
    everything = " ".join(queries(board))
    for metric in (
        "ray_ckpt_total_save_seconds_bucket",
        "ray_ckpt_exclusive_hold_seconds_bucket",
        "ray_ckpt_commit_seconds_bucket",
        "ray_ckpt_bytes_written_total",
        "ray_ckpt_unacknowledged_results",
        "ray_ckpt_restore_seconds_count",
        "ray_ckpt_restore_episodes_total",
    ):
        assert metric in everything, metric
