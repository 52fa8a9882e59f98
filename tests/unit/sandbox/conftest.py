"""A `DirectorySandbox` per test over a fresh root in tmp_path, closed after it
(every sandbox freed, its processes killed)."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator

import pytest

from ray_ckpt.sandbox.directory import DirectorySandbox


@pytest.fixture
def root(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "sandboxes"


@pytest.fixture
async def provider(root: pathlib.Path) -> AsyncIterator[DirectorySandbox]:
    sandbox = DirectorySandbox(root, max_file_bytes=1 << 20)
    try:
        yield sandbox
    finally:
        await sandbox.close()
