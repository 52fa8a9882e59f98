"""A real S3-compatible endpoint on 127.0.0.1 for the storage tests: moto's server.

`s3_endpoint` (session-scoped) starts `python -m moto.server` in its own
process on a free port, creates a bucket, points the environment obstore
reads (`AWS_ENDPOINT_URL`, keys, region, `AWS_ALLOW_HTTP`) at it, and stops
it at the end (`benchmarks.local_s3.moto_endpoint`, which the storage
benchmark's `--local-s3` uses too).  Its own process, so uploads are served off the test's GIL,
and so a test can kill a writer without killing the store.  Import the
fixtures into a test module to use them.
"""

from __future__ import annotations

import pathlib
import uuid
from collections.abc import Iterator

import msgspec
import pytest

from benchmarks.local_s3 import moto_endpoint

BUCKET = "ray-ckpt-tests"


class S3Endpoint(msgspec.Struct, frozen=True):
    url: str
    bucket: str
    env: dict[str, str]  # what a subprocess needs to reach it

    def location(self, name: str = "") -> str:
        """A fresh prefix in the bucket: tests never see each other's objects."""
        return f"s3://{self.bucket}/{name or uuid.uuid4().hex}"


_SHARED: list[S3Endpoint] = []


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Endpoint]:
    if _SHARED:  # imported into several modules: one server for the session
        yield _SHARED[0]
        return
    with moto_endpoint(BUCKET) as (url, env):
        endpoint = S3Endpoint(url=url, bucket=BUCKET, env=env)
        _SHARED.append(endpoint)
        try:
            yield endpoint
        finally:
            _SHARED.clear()


@pytest.fixture(params=["local", "s3"], name="root")
def local_or_s3_root(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> str:
    """`root`: a checkpoint root on the local disk, then in the bucket (import
    it with `s3_endpoint`, which the S3 case starts)."""
    if request.param == "local":
        return str(tmp_path / "root")
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    return endpoint.location()


def s3_client(endpoint: S3Endpoint) -> object:
    """A boto3 client for looking behind obstore (incomplete uploads, raw objects)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint.url)
