"""The documentation's pages and their Python blocks, for the snippet tests.

The pages are README.md, then every page of the mkdocs site in its nav order
(`mkdocs.yml`), then any page under docs/ the nav leaves out.  A block marked
on the line before its fence with `<!-- snippet: skip (why) -->` is not run
(it starts its own Ray, or shows a server that is not installed); it is still
checked without Ray (`tests/unit/gym/test_readme_snippets.py`)."""

from __future__ import annotations

import pathlib
import re
import textwrap
from dataclasses import dataclass
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^[ \t]*```", re.S | re.M)
SKIP = re.compile(r"<!--\s*snippet:\s*skip\b")


@dataclass(frozen=True)
class Snippet:
    page: pathlib.Path
    line: int  # of the fence, 1-based
    code: str
    skip: bool

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _nav_files(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [f for item in nav for f in _nav_files(item)]
    if isinstance(nav, dict):
        return [f for value in nav.values() for f in _nav_files(value)]
    return []


def pages() -> list[pathlib.Path]:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    ordered = [DOCS / f for f in _nav_files(config.get("nav", []))]
    rest = sorted(p for p in DOCS.rglob("*.md") if p not in ordered)
    return [ROOT / "README.md", *(p for p in ordered if p.exists()), *rest]


def snippets(page: pathlib.Path) -> list[Snippet]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        found.append(
            Snippet(
                page=page,
                line=text.count("\n", 0, match.start()) + 1,
                code=textwrap.dedent(match.group(2)),
                skip=bool(SKIP.search(before)),
            )
        )
    return found


def all_snippets() -> list[Snippet]:
    return [s for page in pages() for s in snippets(page)]
