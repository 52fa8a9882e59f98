"""A participant's and the Gym's checkpoint on local disk and on S3 (moto over HTTP).

The same promises on both: a round trip; corruption and truncation refused
whole; a conflicting second commit refused; a writer killed mid-upload
publishes nothing; an unusable location refused with a typed error.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import msgspec
import pytest

from ray_ckpt.errors import InvalidCheckpointState, InvalidRequest
from ray_ckpt.storage import (
    WriteStop,
    open_location,
    read_gym_manifest,
    read_participant,
    verify_checkpoint,
    write_gym_manifest,
    write_participant,
)
from ray_ckpt.storage.blobstore.blobs import Blobs, is_temp
from ray_ckpt.storage.participant.participant_manifest import encode_manifest, participant_key
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.seam import FileRecordStore
from tests.s3_server import S3Endpoint, s3_client, s3_endpoint

__all__ = ["s3_endpoint"]  # the fixture, imported for pytest

KIND, INST = "environment", "env-0"
ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpt")
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    return endpoint.location()


def recs(tag: str = "x", n: int = 6, pad: int = 3000) -> list[Record]:
    return [Record(f"r{i}", {"tag": tag, "i": i, "pad": "p" * pad}) for i in range(n)]


def commit(where: str, cid: str = "c1", tag: str = "x", n: int = 6, pad: int = 3000) -> None:
    manifests = [
        write_participant(
            where, kind=k, instance="i0", checkpoint_id=cid, records=recs(tag + k, n, pad)
        )
        for k in ("agent", "environment")
    ]
    write_gym_manifest(where, checkpoint_id=cid, manifests=manifests)


def records_key(where: str, kind: str = "agent") -> str:
    m = read_participant(where, kind=kind, instance="i0", checkpoint_id=None)[0]
    return f"{participant_key(kind, 'i0')}/{m.records_file}"


def test_round_trip_with_records_over_several_parts(where: str) -> None:
    # ~20 MiB: more than two multipart parts on the store.
    commit(where, n=40, pad=500_000)
    report = verify_checkpoint(where)
    assert report.ok, report
    assert read_gym_manifest(where).checkpoint_id == "c1"
    m, got = read_participant(where, kind="agent", instance="i0", checkpoint_id="c1")
    assert got == recs("xagent", 40, 500_000)
    assert m.bytes > 16 << 20
    _, some = read_participant(
        where, kind="agent", instance="i0", checkpoint_id="c1", select=lambda k: k == "r3"
    )
    assert [r.key for r in some] == ["r3"]


def test_a_flipped_byte_is_refused_whole(where: str) -> None:
    commit(where)
    blobs = open_location(where)
    key = records_key(where)
    data = bytearray(blobs.read(key))
    data[len(data) // 2] ^= 0x01
    blobs.replace(key, bytes(data))
    with pytest.raises(InvalidCheckpointState, match="digest mismatch"):
        read_participant(where, kind="agent", instance="i0", checkpoint_id="c1")
    report = verify_checkpoint(where)
    assert not report.ok
    assert [c.ok for c in report.participants] == [False, True]


@pytest.mark.parametrize("cut", [1, 4000])
def test_a_truncated_records_object_is_refused_whole(where: str, cut: int) -> None:
    commit(where)
    blobs = open_location(where)
    key = records_key(where)
    blobs.replace(key, blobs.read(key)[:-cut])
    with pytest.raises(InvalidCheckpointState, match="truncated"):
        read_participant(where, kind="agent", instance="i0", checkpoint_id="c1")
    assert not verify_checkpoint(where).ok


def test_a_conflicting_second_commit_is_refused_and_changes_nothing(where: str) -> None:
    commit(where, "c1", "old")
    blobs = open_location(where)
    before = {i.key: blobs.read(i.key) for i in blobs.list()}
    with pytest.raises(InvalidCheckpointState, match="different commit"):
        write_participant(
            where, kind="agent", instance="i0", checkpoint_id="c2", records=recs("new")
        )
    with pytest.raises(InvalidCheckpointState, match="different commit"):
        write_participant(  # same checkpoint ID, other records
            where, kind="agent", instance="i0", checkpoint_id="c1", records=recs("new")
        )
    with pytest.raises(InvalidCheckpointState, match="never replaced"):
        write_gym_manifest(where, checkpoint_id="c1", manifests=[])
    assert {i.key: blobs.read(i.key) for i in blobs.list()} == before
    # The identical commit again is accepted and writes nothing new.
    again = write_participant(
        where, kind="agent", instance="i0", checkpoint_id="c1", records=recs("oldagent")
    )
    assert again == read_participant(where, kind="agent", instance="i0", checkpoint_id="c1")[0]
    assert [i.key for i in blobs.list()] == sorted(before)


def test_the_seam_reads_and_writes_any_location(where: str) -> None:
    store = FileRecordStore()
    m = store.write(
        where, kind=KIND, instance=INST, checkpoint_id="c9", records=recs(), stop=store.new_stop()
    )
    write_gym_manifest(where, checkpoint_id="c9", manifests=[m])
    got_m, got = store.read(where, kind=KIND, instance=INST, select=lambda _k: True)
    assert got_m == m
    assert got == recs()


@pytest.mark.parametrize("location", ["ckpt/rel", "s3:/one-slash/x", "ftp://h/x", ""])
def test_the_seam_refuses_an_unusable_location_with_a_typed_error(location: str) -> None:
    store = FileRecordStore()
    with pytest.raises(InvalidRequest) as err:
        store.write(
            location,
            kind=KIND,
            instance=INST,
            checkpoint_id="c1",
            records=recs(),
            stop=store.new_stop(),
        )
    assert err.value.reason.http_status == 400
    with pytest.raises(InvalidRequest):
        store.read(location, kind=KIND, instance=INST, select=lambda _k: True)


def test_a_write_into_a_missing_bucket_is_an_invalid_request(s3_endpoint: S3Endpoint) -> None:
    store = FileRecordStore()
    with pytest.raises(InvalidRequest, match="no-such-bucket"):
        store.write(
            "s3://no-such-bucket/ck",
            kind=KIND,
            instance=INST,
            checkpoint_id="c1",
            records=recs(),
            stop=store.new_stop(),
        )


_UPLOADER = """
import sys, time
from ray_ckpt.storage import write_participant
from ray_ckpt.storage.records.record import Record

def records():
    for i in range(400):
        if i == 60:  # ~30 MiB sent: several parts are up, the rest is in flight
            print("mid-upload", flush=True)
            time.sleep(120)
        yield Record(f"r{i}", {"pad": "p" * 500_000})

write_participant(sys.argv[1], kind="agent", instance="i0", checkpoint_id="c1", records=records())
print("finished", flush=True)
"""


def test_a_writer_killed_mid_upload_publishes_nothing(
    where: str, request: pytest.FixtureRequest
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _UPLOADER, where],
        stdout=subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"mid-upload"
        if where.startswith("s3://"):
            _wait_for_parts(request.getfixturevalue("s3_endpoint"), where)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    blobs = open_location(where)
    # Nothing under a final name: no manifest, no records object (on disk a
    # temp file may be left, named so gc collects it).
    assert [i.key for i in blobs.list() if not is_temp(i.key)] == []
    with pytest.raises(InvalidCheckpointState, match="missing manifest"):
        read_participant(where, kind="agent", instance="i0", checkpoint_id="c1")
    # A new writer then commits normally.
    commit(where)
    assert verify_checkpoint(where).ok


def _wait_for_parts(endpoint: S3Endpoint, where: str) -> None:
    """Until the killed writer's multipart upload has parts stored (so the
    kill lands mid-upload, not before it began)."""
    client = s3_client(endpoint)
    prefix = where.removeprefix(f"s3://{endpoint.bucket}/")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        uploads = client.list_multipart_uploads(Bucket=endpoint.bucket, Prefix=prefix)  # type: ignore[attr-defined]
        for u in uploads.get("Uploads", []):
            parts = client.list_parts(Bucket=endpoint.bucket, Key=u["Key"], UploadId=u["UploadId"])  # type: ignore[attr-defined]
            if len(parts.get("Parts", [])) >= 2:
                return
        time.sleep(0.05)
    raise AssertionError("no multipart upload with parts appeared")


def test_a_stop_while_records_stream_publishes_nothing_and_leaves_no_upload(
    where: str, request: pytest.FixtureRequest
) -> None:
    stop = WriteStop()

    def stream() -> Iterator[Record]:
        for i in range(40):
            if i == 30:  # ~15 MiB in: on the store, a multipart upload is under way
                stop.stop()
            yield Record(f"r{i}", {"pad": "p" * 500_000})

    with pytest.raises(InvalidCheckpointState, match="write stopped"):
        write_participant(
            where, kind="agent", instance="i0", checkpoint_id="c1", records=stream(), stop=stop
        )
    assert open_location(where).list() == []
    if where.startswith("s3://"):
        endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
        prefix = where.removeprefix(f"s3://{endpoint.bucket}/")
        uploads = s3_client(endpoint).list_multipart_uploads(  # type: ignore[attr-defined]
            Bucket=endpoint.bucket, Prefix=prefix
        )
        assert uploads.get("Uploads", []) == []  # aborted, not left to a lifecycle rule


class _Racing:
    """A `Blobs` that lets a rival writer commit just before our manifest create."""

    def __init__(self, inner: Blobs, rival: Callable[[], object]) -> None:
        self._inner = inner
        self._rival: Callable[[], object] | None = rival

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def create(self, key: str, data: bytes) -> bytes | None:
        if self._rival is not None and key.endswith("/manifest.json"):
            rival, self._rival = self._rival, None
            rival()
        return self._inner.create(key, data)


def test_losing_the_manifest_race_refuses_and_removes_only_its_own_records(where: str) -> None:
    inner = open_location(where)

    def rival() -> object:
        return write_participant(
            inner, kind="agent", instance="i0", checkpoint_id="c1", records=recs("rival")
        )

    racing = cast(Blobs, _Racing(inner, rival))
    with pytest.raises(InvalidCheckpointState, match="different commit"):
        write_participant(
            racing, kind="agent", instance="i0", checkpoint_id="c1", records=recs("mine")
        )
    m, got = read_participant(where, kind="agent", instance="i0", checkpoint_id="c1")
    assert got == recs("rival")
    assert [i.key for i in inner.list()] == sorted(
        [f"gym/agent/i0/{m.records_file}", "gym/agent/i0/manifest.json"]
    )


def test_the_same_records_racing_is_one_commit(where: str) -> None:
    inner = open_location(where)

    def twin() -> object:
        return write_participant(
            inner, kind="agent", instance="i0", checkpoint_id="c1", records=recs("same")
        )

    racing = cast(Blobs, _Racing(inner, twin))
    mine = write_participant(
        racing, kind="agent", instance="i0", checkpoint_id="c1", records=recs("same")
    )
    assert mine == read_participant(where, kind="agent", instance="i0", checkpoint_id="c1")[0]
    assert len(inner.list()) == 2  # the winner's records and manifest only


def test_records_named_by_their_digest_are_still_read(where: str) -> None:
    """Checkpoints written before records were named by a token still restore."""
    m = write_participant(where, kind="agent", instance="i0", checkpoint_id="c1", records=recs())
    blobs = open_location(where)
    pkey = participant_key("agent", "i0")
    old_name = f"records-{m.digest}.msgpack"
    blobs.create(f"{pkey}/{old_name}", blobs.read(f"{pkey}/{m.records_file}"))
    blobs.delete([f"{pkey}/{m.records_file}", f"{pkey}/manifest.json"])
    old = msgspec.structs.replace(m, records_file=old_name)
    blobs.create(f"{pkey}/manifest.json", encode_manifest(old))
    write_gym_manifest(where, checkpoint_id="c1", manifests=[old])
    got_m, got = read_participant(where, kind="agent", instance="i0", checkpoint_id="c1")
    assert got_m.records_file == old_name
    assert got == recs()
    assert verify_checkpoint(where).ok
