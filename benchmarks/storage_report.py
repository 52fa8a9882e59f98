"""The storage benchmark's ratios, goals, beaten-floor checks and table.

A ratio over a floor (commit over the raw write of the same bytes, restore
over the raw read + bare decode) means something only if the floor is one:
when what it bounds beats it, the run measured noise or a wrong baseline,
so the figure is listed in `warnings` (and the table says INVALID) instead
of being passed off as a ratio under 1.  The goals are printed next to the
figures with pass or fail; a goal on an invalid figure neither passes nor
fails.
"""

from __future__ import annotations

from typing import Any

# figure (a top-level key, or mixes.<mix>.<key>) -> the most it may be
GOALS: dict[str, float] = {
    "mixes.text.commit_ratio": 1.5,
    "incremental_bytes_ratio": 0.15,
    "incremental_commit_ratio": 0.25,
    "chain_restore_ratio": 1.2,
    "s3_commit_ratio": 1.5,
}

# ratio -> (what it bounds, its floor): a ratio under 1 means the floor was beaten
FLOORS: dict[str, tuple[str, str]] = {
    "commit_ratio": ("commit_s", "raw_write_s"),
    "restore_ratio": ("restore_s", "raw_read_decode_s"),
}

SUMMED = (
    "commit_s",
    "restore_s",
    "raw_write_s",
    "raw_read_s",
    "raw_read_decode_s",
    "peer_commit_s",
    "peer_restore_s",
    "check_s",
    "state_mb",
)
# Summed over the mixes for the ratios and the table, kept out of the JSON's top level.
DETAIL = (
    "records_mb",
    "full_mb",
    "inc_mb",
    "inc_commit_s",
    "chain_restore_s",
    "raw_chain_read_s",
    "raw_write_buffered_s",  # on disk only
    "raw_write_plain_s",  # on disk only
)


def ratios(r: dict[str, float]) -> dict[str, float]:
    out = {
        "commit_ratio": r["commit_s"] / r["raw_write_s"],
        "restore_ratio": r["restore_s"] / r["raw_read_decode_s"],
        "vs_peer_commit": r["commit_s"] / r["peer_commit_s"],
        "vs_peer_restore": r["restore_s"] / r["peer_restore_s"],
    }
    if "inc_commit_s" in r:
        out["incremental_bytes_ratio"] = r["inc_mb"] / r["full_mb"]
        out["incremental_commit_ratio"] = r["inc_commit_s"] / r["commit_s"]
        out["chain_restore_ratio"] = r["chain_restore_s"] / r["restore_s"]
    if "raw_chain_read_s" in r:
        out["raw_chain_over_raw_read"] = r["raw_chain_read_s"] / r["raw_read_s"]
    return out


def figure(out: dict[str, Any], name: str) -> float | None:
    node: Any = out
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return float(node)


def beaten_floors(out: dict[str, Any]) -> list[dict[str, str]]:
    """One warning per ratio whose floor was beaten, top level and per mix."""
    checks = [(name, out, what, floor) for name, (what, floor) in FLOORS.items()]
    for mix, node in out["mixes"].items():
        checks += [(f"mixes.{mix}.{n}", node, what, floor) for n, (what, floor) in FLOORS.items()]
    if "s3_commit_s" in out:
        checks.append(("s3_commit_ratio", out, "s3_commit_s", "raw_write_s"))
    return [
        {
            "figure": name,
            "why": f"{what} {node[what]:.3f} s beat its floor {floor} {node[floor]:.3f} s: "
            "the floor does not bound it in this run (noise, or a baseline that is not "
            "the same work), so the ratio is not one",
        }
        for name, node, what, floor in checks
        if node[what] < node[floor]
    ]


def goals(out: dict[str, Any], invalid: set[str]) -> dict[str, dict[str, Any]]:
    result = {}
    for name, most in GOALS.items():
        value = figure(out, name)
        if value is None:
            continue
        valid = name not in invalid
        result[name] = {
            "value": value,
            "goal": most,
            "met": valid and value <= most,
            "valid": valid,
        }
    return result


COLUMNS = (
    "state_mb",
    "records_mb",
    "commit_s",
    "peer_commit_s",
    "raw_write_s",
    "raw_write_buffered_s",
    "raw_write_plain_s",
    "restore_s",
    "peer_restore_s",
    "raw_read_s",
    "raw_read_decode_s",
    "check_s",
    "commit_rss_mb",
    "restore_rss_mb",
    "peer_restore_rss_mb",
    "full_mb",
    "inc_mb",
    "inc_commit_s",
    "chain_restore_s",
    "raw_chain_read_s",
    "commit_ratio",
    "restore_ratio",
    "vs_peer_commit",
    "vs_peer_restore",
    "incremental_bytes_ratio",
    "incremental_commit_ratio",
    "chain_restore_ratio",
    "raw_chain_over_raw_read",
)


def table(out: dict[str, Any]) -> str:
    mixes: dict[str, dict[str, float]] = out["mixes"]
    invalid = {w["figure"] for w in out["warnings"]}
    lines = [
        f"{out['sessions']} sessions x {out['kb']} KB in {out['location']} "
        f"(medians of {out['reps']} interleaved repetitions; baselines from the same run)",
        f"{'':26}" + "".join(f"{m:>12}" for m in mixes) + f"{'total':>12}",
    ]
    for c in COLUMNS:
        if not any(c in m for m in mixes.values()):
            continue
        cells = [mixes[m].get(c) for m in mixes] + [out.get(c)]
        row = "".join(f"{'':>12}" if v is None else f"{v:>12.3f}" for v in cells)
        bad = [n for n in (f"mixes.{m}.{c}" for m in mixes) if n in invalid]
        lines.append(f"{c:26}{row}" + ("   INVALID: floor beaten" if bad or c in invalid else ""))
    width = 12 * (len(mixes) + 1)  # the total column
    for c in ("s3_commit_s", "s3_restore_s", "s3_commit_ratio"):
        if c in out:
            lines.append(f"{c:26}{out[c]:>{width}.3f}" + ("   INVALID" if c in invalid else ""))
    lines.append("goals:")
    for name, g in out["goals"].items():
        verdict = "pass" if g["met"] else ("INVALID" if not g["valid"] else "FAIL")
        lines.append(f"  {name:32} {g['value']:8.3f}  <= {g['goal']:<5}  {verdict}")
    if "s3_commit_ratio" not in out["goals"]:
        lines.append(f"  {'s3_commit_ratio':32} {'n/a':>8}  (needs an s3:// location)")
    for w in out["warnings"]:
        lines.append(f"WARNING {w['figure']}: {w['why']}")
    return "\n".join(lines)
