"""What must hold after every partition scenario, checked on the driver's summary."""

from __future__ import annotations

from typing import Any


def check(summary: dict[str, Any]) -> None:
    """No episode lost or duplicated, every finished result delivered exactly
    once, results equal the uninterrupted run's, LATEST names a complete
    checkpoint, and a checkpoint that failed left nothing that verifies."""
    expected = summary["expected"]
    lost = sorted(set(expected) - set(summary["digests"]))
    assert not lost, f"lost: {lost}; failures: {summary['failures']}"
    assert summary["finished"] == dict.fromkeys(expected, 1), f"finishes: {summary['finished']}"
    assert summary["digests"] == expected, "results differ from the uninterrupted run's"
    latest = summary["latest"]
    assert latest is not None, "no LATEST after the scenario"
    assert latest["ok"], f"LATEST names {latest['name']}, which does not verify"
    outcomes = {c["name"]: c["outcome"] for c in summary["checkpoints"]}
    assert outcomes.get(latest["name"]) == "ok", f"LATEST names a failed checkpoint: {latest}"
    for name, outcome in outcomes.items():
        if outcome != "ok":
            assert not summary["verified"][name], f"{name} failed ({outcome}) yet verifies"
