"""The installed packages stand on their own: no test-only dependency, typed.

Imports every module of the three packages in a fresh interpreter (so what
the test session already imported cannot hide a dependency) and checks that
none of the test or benchmark extras came with them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("ray_ckpt", "participants", "coordination")
TEST_ONLY = ("fastapi", "httpx", "hypothesis", "pytest", "psutil", "moto", "boto3", "botocore")

_PROBE = """
import importlib, json, pkgutil, sys
for name in {packages!r}:
    pkg = importlib.import_module(name)
    for info in pkgutil.walk_packages(pkg.__path__, name + "."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
print(json.dumps(sorted(m for m in {test_only!r} if m in sys.modules)))
"""


def test_no_installed_module_imports_a_test_only_dependency() -> None:
    probe = _PROBE.format(packages=PACKAGES, test_only=TEST_ONLY)
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_every_package_ships_py_typed() -> None:
    for name in PACKAGES:
        assert (ROOT / name / "py.typed").is_file(), name
