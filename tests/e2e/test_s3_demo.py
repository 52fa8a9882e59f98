"""The main job with its checkpoint in S3: `python -m coordination.demo --checkpoint-dir s3://…`.

Against moto's S3 server on 127.0.0.1 (`tests/s3_server.py`).  The demo runs
as its own process with its own embedded Ray (the shared cluster's workers
were started before the endpoint's environment existed), so every actor that
commits or restores reaches the store through the environment obstore reads.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from ray_ckpt.storage import open_location, verify_checkpoint
from tests.s3_server import S3Endpoint, s3_endpoint

__all__ = ["s3_endpoint"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_demo_checkpoints_into_s3_and_continues_with_equal_results(
    s3_endpoint: S3Endpoint,
) -> None:
    location = s3_endpoint.location("demo")
    env = {
        **os.environ,
        **s3_endpoint.env,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "PYTHONPATH": str(ROOT),
    }
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "coordination.demo",
            "--checkpoint-dir",
            location,
            "--rollouts",
            "3",
            "--steps",
            "2",
            "--json",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["equal"] is True, summary
    assert summary["ok"] is True, summary["problems"]
    assert summary["episodes_in_flight_at_checkpoint"] > 0
    assert summary["lost"] == []
    assert summary["different"] == []
    assert summary["episodes_restarted"] == 0
    # The checkpoint is in the bucket, complete, and nothing went to a local
    # directory named after the URI (the old failure: `s3:/bucket/...`).
    report = verify_checkpoint(location)
    assert report.ok, report
    assert report.checkpoint_id == summary["checkpoint_id"]
    keys = [i.key for i in open_location(location).list()]
    assert "gym/_manifest.json" in keys
    assert len([k for k in keys if k.endswith("/manifest.json")]) == 4
    assert not (ROOT / "s3:").exists()
