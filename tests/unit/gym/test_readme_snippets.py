"""The README's Python snippets against the code, so they cannot drift: each
parses, its imports import, and every call it makes on the handle (`gym.x(...)`)
or on a `PendingCheckpoint` names a method that exists and keywords it takes.
(Without Ray; `tests/e2e/test_readme_runs.py` runs them on the shared cluster.)"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re
import textwrap

import pytest

from coordination.client.handle import CoordinatorHandle
from coordination.client.pending import PendingCheckpoint

README = pathlib.Path(__file__).resolve().parents[3] / "README.md"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
RECEIVERS = {"gym": CoordinatorHandle, "pending": PendingCheckpoint}


def snippets() -> list[str]:
    return [textwrap.dedent(b) for b in BLOCK.findall(README.read_text())]


def test_the_readme_has_python_snippets() -> None:
    assert len(snippets()) >= 4


@pytest.mark.parametrize("index", range(len(snippets())))
def test_a_snippet_matches_the_code(index: int) -> None:
    tree = ast.parse(snippets()[index])
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


def test_the_settings_block_loads() -> None:
    """The README's `checkpoint:` YAML is what `settings_from_dict` accepts
    (an unknown or misspelt key would be refused)."""
    import yaml

    from ray_ckpt.settings import settings_from_dict

    block = re.search(r"### Settings\n\n```yaml\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    settings = settings_from_dict(yaml.safe_load(block.group(1)))
    assert settings.enabled
