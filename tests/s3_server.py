"""A real S3-compatible endpoint on 127.0.0.1 for the storage tests: moto's server.

`s3_endpoint` (session-scoped) starts `python -m moto.server` in its own
process on a free port, creates a bucket, points the environment obstore
reads (`AWS_ENDPOINT_URL`, keys, region, `AWS_ALLOW_HTTP`) at it, and stops
it at the end.  Its own process, so uploads are served off the test's GIL,
and so a test can kill a writer without killing the store.  Import the
fixtures into a test module to use them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import msgspec
import pytest

BUCKET = "ray-ckpt-tests"


class S3Endpoint(msgspec.Struct, frozen=True):
    url: str
    bucket: str
    env: dict[str, str]  # what a subprocess needs to reach it

    def location(self, name: str = "") -> str:
        """A fresh prefix in the bucket: tests never see each other's objects."""
        return f"s3://{self.bucket}/{name or uuid.uuid4().hex}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(proc: subprocess.Popen[bytes], port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("moto server did not start")


_SHARED: list[S3Endpoint] = []


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    if _SHARED:  # imported into several modules: one server for the session
        yield _SHARED[0]
        return
    import boto3

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    env = {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    saved = {k: os.environ.get(k) for k in env}
    try:
        _wait_ready(proc, port)
        os.environ.update(env)
        boto3.client("s3", endpoint_url=url).create_bucket(Bucket=BUCKET)
        endpoint = S3Endpoint(url=url, bucket=BUCKET, env=env)
        _SHARED.append(endpoint)
        yield endpoint
    finally:
        _SHARED.clear()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def s3_client(endpoint: S3Endpoint) -> object:
    """A boto3 client for looking behind obstore (incomplete uploads, raw objects)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint.url)
