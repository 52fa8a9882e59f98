"""A throwaway S3 endpoint on 127.0.0.1 for `storage.py --local-s3`: moto's server.

The storage tests' endpoint too (`tests/s3_server.py` uses `moto_endpoint`): its
own `python -m moto.server` process on a free loopback port, so uploads are
served off the benchmark's GIL, with the environment obstore reads
(`AWS_ENDPOINT_URL`, test keys, region, `AWS_ALLOW_HTTP`) pointed at it for
the duration of the block.  moto is a test extra; the benchmark needs it
only with `--local-s3`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

BUCKET = "ray-ckpt-bench"


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
    raise RuntimeError("moto server did not start within 30 s")


def _create_bucket(url: str, bucket: str) -> None:
    # obstore cannot create buckets; boto3 comes with moto[server].
    import boto3  # type: ignore[import-untyped]

    boto3.client("s3", endpoint_url=url).create_bucket(Bucket=bucket)


@contextlib.contextmanager
def moto_endpoint(bucket: str) -> Iterator[tuple[str, dict[str, str]]]:
    """Start moto's server with `bucket` on it; yield (URL, the env obstore
    reads), set in `os.environ` for the block; stop it and restore the env."""
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
        _create_bucket(url, bucket)
        yield url, env
    finally:
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


@contextlib.contextmanager
def local_s3() -> Iterator[str]:
    """Start the endpoint, yield `s3://<bucket>` on it, stop it and restore the env."""
    with moto_endpoint(BUCKET):
        yield f"s3://{BUCKET}"
