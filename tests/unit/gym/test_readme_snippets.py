"""The README's and every docs page's Python blocks against the code, so they
cannot drift: each parses, its imports import, and every call it makes on the
handle (`gym.x(...)`) or on a `PendingCheckpoint` names a method that exists
and keywords it takes; every `ray-ckpt` command and every script a page names
exists.  (Without Ray; `tests/e2e/test_readme_runs.py` runs the blocks on the
shared cluster.  A block marked `<!-- snippet: skip (why) -->` is checked here
and not run there: see `tests/doc_pages.py`.)"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pathlib
import re

import pytest

from coordination.client.handle import CoordinatorHandle
from coordination.client.pending import PendingCheckpoint
from tests.doc_pages import DOCS, ROOT, Snippet, all_snippets, pages

RECEIVERS = {"gym": CoordinatorHandle, "pending": PendingCheckpoint}
# A command line: `ray-ckpt X ...` (an inline span, or a line of a block), a path before it allowed.
COMMAND = re.compile(r"^[ \t$]*(?:\S*/)?ray-ckpt ([a-z][a-z-]*)", re.M)
SCRIPT = re.compile(r"\bpython3?\s+((?:examples|benchmarks)/[\w/]+\.py)")
MODULE = re.compile(r"\bpython3?\s+-m\s+((?:coordination|ray_ckpt|participants)[\w.]*)")
# Code only: fenced blocks and inline code spans (a span may wrap a line).
CODE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```|`([^`]+)`", re.S | re.M)
SNIPPETS = all_snippets()


def test_the_readme_and_the_docs_have_python_blocks() -> None:
    assert pages()[0] == ROOT / "README.md"
    assert sum(s.page == ROOT / "README.md" for s in SNIPPETS) >= 1
    assert sum(not s.skip for s in SNIPPETS) >= 8


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.name for s in SNIPPETS])
def test_a_snippet_matches_the_code(snippet: Snippet) -> None:
    tree = ast.parse(snippet.code)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
            if not (isinstance(target, ast.Name) and target.id in RECEIVERS):
                continue
            cls = RECEIVERS[target.id]
            method = getattr(cls, node.func.attr, None)
            assert callable(method), f"{target.id}.{node.func.attr} does not exist"
            params = inspect.signature(method).parameters
            takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
            for kw in node.keywords:
                assert kw.arg is None or takes_any or kw.arg in params, (
                    f"{target.id}.{node.func.attr}() takes no {kw.arg!r}"
                )


@pytest.mark.parametrize("page", pages(), ids=[str(p.relative_to(ROOT)) for p in pages()])
def test_the_commands_and_scripts_a_page_names_exist(page: pathlib.Path) -> None:
    from coordination.demo.app import main

    text = "\n".join(a or b for a, b in CODE.findall(page.read_text()))
    commands = set(main.commands)
    for name in COMMAND.findall(text):
        assert name in commands, f"ray-ckpt {name} is not a command ({sorted(commands)})"
    for path in SCRIPT.findall(text):
        assert (ROOT / path).is_file(), f"{path} does not exist"
    for module in MODULE.findall(text):
        assert importlib.util.find_spec(module) is not None, f"python -m {module}"


def test_the_settings_block_loads() -> None:
    """The settings page's `checkpoint:` YAML is what `settings_from_dict`
    accepts (an unknown or misspelt key would be refused)."""
    import yaml

    from ray_ckpt.settings import settings_from_dict

    page = (DOCS / "reference" / "settings.md").read_text()
    block = re.search(r"```yaml\n(checkpoint:.*?)```", page, re.S)
    assert block is not None
    settings = settings_from_dict(yaml.safe_load(block.group(1)))
    assert settings.enabled


def test_ci_runs_the_readmes_test_command_and_the_first_command_installs_no_extra() -> None:
    """The README's two commands: the first installs the project alone (what
    the demo needs), the second is the line `.ci/run` runs; the getting
    started page shows the same two."""
    bash = re.compile(r"```bash\n(.*?)```", re.S)
    first, test = (b.strip() for b in bash.findall((ROOT / "README.md").read_text())[:2])
    assert first == "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/ray-ckpt demo"
    assert test in (ROOT / ".ci" / "run").read_text().splitlines()
    assert "pytest" in test
    assert bash.findall((DOCS / "guide" / "getting-started.md").read_text())[:2] == [
        first + "\n",
        test + "\n",
    ]
