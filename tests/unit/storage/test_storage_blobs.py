"""The byte-store seam: `open_location` parsing and each `Blobs` guarantee.

The guarantee tests take a `blobs` fixture so every backend runs the same ones.
"""

from __future__ import annotations

import os
import pathlib

import pytest

from ray_ckpt.errors import InvalidCheckpointState, InvalidRequest, ParticipantUnavailable
from ray_ckpt.storage.blobstore.blobs import BlobMissing, Blobs, check_key, is_temp, temp_key
from ray_ckpt.storage.blobstore.local_blobs import LocalBlobs
from ray_ckpt.storage.blobstore.locations import check_location, open_location
from ray_ckpt.storage.blobstore.object_blobs import PART, ObjectBlobs
from tests.s3_server import S3Endpoint, s3_client, s3_endpoint

__all__ = ["s3_endpoint"]  # the fixture, imported for pytest


@pytest.fixture(params=["local", "s3"])
def blobs(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Blobs:
    if request.param == "local":
        return open_location(str(tmp_path / "root"))
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    return open_location(endpoint.location())


@pytest.mark.parametrize(
    "location",
    ["", "ckpts/run1", "./x", "s3:/bucket/x", "ftp://host/x", "hdfs://nn/x", "file://h/x", "/a\0b"],
)
def test_unusable_location_is_refused_naming_it(location: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        open_location(location)
    assert repr(location) in str(err.value)
    assert err.value.reason.http_status == 400


def test_absolute_path_and_file_uri_open_the_same_directory(tmp_path: pathlib.Path) -> None:
    a = open_location(str(tmp_path))
    b = open_location(f"file://{tmp_path}")
    c = open_location(tmp_path)  # a PathLike, as existing callers pass
    assert isinstance(a, LocalBlobs)
    assert isinstance(b, LocalBlobs)
    assert isinstance(c, LocalBlobs)
    assert a.root == b.root == c.root == tmp_path
    assert b.url == f"file://{tmp_path}"
    a.create("k", b"v")
    assert b.read("k") == b"v"


def test_keys_cannot_escape_the_root() -> None:
    for key in ("", "/abs", "a/../b", "a//b", ".", "a/./b"):
        with pytest.raises(InvalidCheckpointState):
            check_key(key)


def test_temp_keys_are_recognised() -> None:
    t = temp_key("gym/a/b/records-x.msgpack")
    assert t.startswith("gym/a/b/.records-x.msgpack.")
    assert is_temp(t)
    assert is_temp(temp_key("LATEST"))
    assert temp_key("LATEST") != temp_key("LATEST")
    for key in ("LATEST", "gym/a/manifest.json", ".hidden", "a/.x.tmp"):
        assert not is_temp(key)


def test_create_is_create_only(blobs: Blobs) -> None:
    assert blobs.create("a/manifest.json", b"one") is None
    assert blobs.create("a/manifest.json", b"two") == b"one"
    assert blobs.read("a/manifest.json") == b"one"


def test_missing_key_raises_blob_missing(blobs: Blobs) -> None:
    with pytest.raises(BlobMissing):
        blobs.read("nope")
    with pytest.raises(BlobMissing):
        blobs.stream("nope")
    assert not blobs.exists("nope")


def test_read_range_into_fills_the_given_view_and_stops_at_the_end(blobs: Blobs) -> None:
    data = bytes(range(256)) * 4
    assert blobs.create("a/records", data) is None
    buf = bytearray(b"x" * 64)
    got = blobs.read_range_into("a/records", 100, memoryview(buf)[8:40])
    assert bytes(got) == data[100:132]
    assert buf[:8] == b"x" * 8  # only the view is written
    assert buf[40:] == b"x" * 24
    tail = blobs.read_range_into("a/records", len(data) - 10, bytearray(64))
    assert bytes(tail) == data[-10:]  # the object ended first
    with pytest.raises(BlobMissing):
        blobs.read_range_into("nope", 0, bytearray(8))


def test_upload_streams_and_publishes_on_clean_exit(blobs: Blobs) -> None:
    parts = [os.urandom(1 << 20) for _ in range(5)]
    with blobs.upload("gym/k/i/records-1.msgpack") as up:
        for p in parts:
            up.write(p)
        assert not blobs.exists("gym/k/i/records-1.msgpack")
    assert b"".join(blobs.stream("gym/k/i/records-1.msgpack")) == b"".join(parts)
    assert [i.key for i in blobs.list()] == ["gym/k/i/records-1.msgpack"]


def test_failed_upload_publishes_nothing(blobs: Blobs) -> None:
    def fail() -> None:
        with blobs.upload("r.msgpack") as up:
            up.write(b"x" * 1000)
            raise RuntimeError("encode failed")

    with pytest.raises(RuntimeError):
        fail()
    assert blobs.list() == []


def test_upload_onto_a_taken_key_is_refused(blobs: Blobs) -> None:
    blobs.create("r", b"first")

    def second() -> None:
        with blobs.upload("r") as up:
            up.write(b"second")

    with pytest.raises(InvalidCheckpointState):
        second()
    assert blobs.read("r") == b"first"
    assert [i.key for i in blobs.list()] == ["r"]


def test_replace_swaps_and_leaves_no_temp(blobs: Blobs) -> None:
    blobs.replace("LATEST", b"c1")
    blobs.replace("LATEST", b"c2")
    assert blobs.read("LATEST") == b"c2"
    assert [i.key for i in blobs.list()] == ["LATEST"]


def test_list_is_recursive_sorted_and_prefixed(blobs: Blobs) -> None:
    for key in ("b/2", "a/1", "b/c/3", "bb"):
        blobs.create(key, key.encode())
    infos = blobs.list()
    assert [i.key for i in infos] == ["a/1", "b/2", "b/c/3", "bb"]
    assert [i.size for i in infos] == [3, 3, 5, 2]
    assert [i.key for i in blobs.list("b/")] == ["b/2", "b/c/3"]
    assert [i.key for i in blobs.list("b")] == ["b/2", "b/c/3"]
    assert blobs.list("zzz/") == []


def test_delete_is_batched_and_tolerates_gone_keys(blobs: Blobs) -> None:
    keys = [f"d/{i}" for i in range(10)]
    for key in keys:
        blobs.create(key, b"x")
    blobs.delete([*keys[:7], "d/never"])
    assert [i.key for i in blobs.list()] == keys[7:]
    blobs.delete([])


def test_check_location_for_write_creates_root_and_leaves_nothing(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "new" / "root"
    blobs = check_location(str(root), for_write=True)
    assert root.is_dir()
    assert blobs.list() == []


def test_check_location_for_read_needs_an_existing_root(tmp_path: pathlib.Path) -> None:
    check_location(str(tmp_path), for_write=False)
    with pytest.raises(InvalidRequest, match="missing"):
        check_location(str(tmp_path / "missing"), for_write=False)


def test_check_location_refuses_an_unwritable_root(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(InvalidRequest, match="file/sub"):
        check_location(str(blocker / "sub"), for_write=True)


def test_a_large_upload_goes_multipart_and_an_abort_leaves_no_upload(
    s3_endpoint: S3Endpoint,
) -> None:
    blobs = open_location(s3_endpoint.location())
    assert isinstance(blobs, ObjectBlobs)
    body = os.urandom(PART * 2 + 12345)
    with blobs.upload("big") as up:
        for i in range(0, len(body), 1 << 20):
            up.write(body[i : i + (1 << 20)])
    assert blobs.read("big") == body
    assert blobs.info("big").size == len(body)

    def fail() -> None:
        with blobs.upload("torn") as up:
            up.write(body)
            raise RuntimeError("encode failed")

    with pytest.raises(RuntimeError):
        fail()
    assert not blobs.exists("torn")
    client = s3_client(s3_endpoint)
    uploads = client.list_multipart_uploads(Bucket=s3_endpoint.bucket).get("Uploads", [])  # type: ignore[attr-defined]
    assert [u for u in uploads if u["Key"].endswith("/torn")] == []


def test_object_store_urls_are_checked(s3_endpoint: S3Endpoint) -> None:
    for bad in ("s3://", "s3:///x", "s3://b/x?y=1", "s3://b/a/../c"):
        with pytest.raises(InvalidRequest):
            open_location(bad)
    url = s3_endpoint.location()
    assert open_location(url).url == url


def test_credentials_in_a_uri_are_refused_and_never_echoed() -> None:
    with pytest.raises(InvalidRequest) as err:
        open_location("s3://AKIA:s3cr3t@bucket/x")
    assert "s3cr3t" not in str(err.value)
    assert "AKIA" not in str(err.value)
    assert "bucket/x" in str(err.value)


def test_check_location_on_the_store(s3_endpoint: S3Endpoint) -> None:
    url = s3_endpoint.location()
    blobs = check_location(url, for_write=True)
    assert blobs.list() == []
    with pytest.raises(InvalidRequest, match="no-such-bucket"):
        check_location("s3://no-such-bucket/x", for_write=True)
    with pytest.raises(InvalidRequest, match="no-such-bucket"):
        check_location("s3://no-such-bucket/x", for_write=False)
    with pytest.raises(InvalidRequest, match="nothing"):
        check_location(url, for_write=False)  # nothing written there yet
    blobs.create("gym/_manifest.json", b"{}")
    check_location(url, for_write=False)


def test_unreachable_store_is_refused_without_leaking_credentials(
    s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-never-shown")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens
    with pytest.raises((InvalidRequest, ParticipantUnavailable)) as err:
        check_location(s3_endpoint.location(), for_write=True)
    assert "s3cr3t" not in str(err.value)
    assert s3_endpoint.bucket in str(err.value)


def test_local_os_errors_come_out_typed(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    blobs = open_location(str(blocker / "sub"))
    for call in (
        lambda: blobs.create("k", b"v"),
        lambda: blobs.replace("k", b"v"),
        lambda: blobs.read("k"),
        lambda: blobs.upload("k").__enter__(),
    ):
        with pytest.raises(InvalidRequest, match="file/sub"):
            call()
