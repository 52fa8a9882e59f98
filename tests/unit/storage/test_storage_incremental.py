"""Incremental checkpoints on local disk and on S3 (moto over HTTP).

A participant writes only the records that changed since its last commit
and references the rest in the earlier records files; restore reads across
files and verifies every referenced frame.  Chains are bounded, gc keeps
what a kept checkpoint references, and anything unsafe to point into makes
a full checkpoint.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage import (
    open_location,
    read_participant,
    verify_checkpoint,
    write_gym_manifest,
    write_participant,
)
from ray_ckpt.storage.blobstore.locations import join_location
from ray_ckpt.storage.participant import referenced
from ray_ckpt.storage.participant.incremental import ChainPolicy, Previous
from ray_ckpt.storage.participant.participant_manifest import ParticipantManifest, participant_key
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.records.records_format import MAGIC
from ray_ckpt.storage.root.catalog import scan
from ray_ckpt.storage.root.retention import collect
from ray_ckpt.storage.seam import FileRecordStore
from tests.s3_server import local_or_s3_root, s3_endpoint

__all__ = ["local_or_s3_root", "s3_endpoint"]  # the fixtures, imported for pytest

KIND, INST = "agent", "i0"
PKEY = participant_key(KIND, INST)


def rec(i: int, gen: int, *, versioned: bool = True, pad: int = 2000) -> Record:
    state = {"i": i, "gen": gen, "pad": chr(97 + gen % 26) * pad}
    return Record(f"r{i:03d}", state, str(gen) if versioned else None)


class Step:
    def __init__(self, location: str, manifest: ParticipantManifest, records: list[Record]):
        self.location, self.manifest, self.records = location, manifest, records


def write(
    root: str,
    name: str,
    records: list[Record],
    previous: Step | None = None,
    policy: ChainPolicy | None = None,
    gym: bool = True,
    stop: Any = None,
) -> Step:
    where = join_location(root, name)
    m = write_participant(
        where,
        kind=KIND,
        instance=INST,
        checkpoint_id=f"c-{name}",
        records=records,
        previous=Previous(previous.location, previous.manifest) if previous else None,
        policy=policy,
        stop=stop,
    )
    if gym:
        write_gym_manifest(where, checkpoint_id=f"c-{name}", manifests=[m])
    return Step(where, m, records)


def chain(
    root: str, depth: int, *, n: int = 20, changed: int = 2, versioned: bool = True, **kw: Any
) -> list[Step]:
    """`depth` checkpoints; each changes the next `changed` records (rotating)."""
    gens = [0] * n
    steps: list[Step] = []
    for c in range(depth):
        if c:
            for j in range(changed):
                gens[(c * changed + j) % n] = c
        records = [rec(i, g, versioned=versioned) for i, g in enumerate(gens)]
        steps.append(write(root, f"ck-{c}", records, steps[-1] if steps else None, **kw))
    return steps


def restored(step: Step) -> list[tuple[str, Any]]:
    _, got = read_participant(step.location, kind=KIND, instance=INST, checkpoint_id=None)
    return [(r.key, r.state) for r in got]


def expected(step: Step) -> list[tuple[str, Any]]:
    return sorted((r.key, r.state) for r in step.records)


def records_key(step: Step) -> str:
    name = step.location.rstrip("/").rpartition("/")[2]
    return f"{name}/{PKEY}/{step.manifest.records_file}"


@pytest.mark.parametrize("versioned", [True, False], ids=["version", "digest"])
def test_round_trip_through_a_chain_of_depth_k(root: str, versioned: bool) -> None:
    steps = chain(root, 4, versioned=versioned, policy=ChainPolicy(full_every=4))
    assert [s.manifest.chain_depth for s in steps] == [0, 1, 2, 3]
    for s in steps:
        assert restored(s) == expected(s)
        report = verify_checkpoint(s.location)
        assert report.ok, report
    last = steps[-1].manifest
    # Flattened: each reference names the file that holds the frame, which is
    # that checkpoint's own records file, at the offset its own index gives.
    own = {f"ck-{i}": steps[i].manifest for i in range(3)}
    assert {r.checkpoint for r in last.refs} == {"ck-0", "ck-1", "ck-2"}
    for ref in last.refs:
        holder = own[ref.checkpoint]
        assert ref.records_file == holder.records_file
        assert (ref.key, ref.offset, ref.length, ref.digest) in {
            (f.key, f.offset, f.length, f.digest) for f in holder.frames
        }
    assert last.record_count == 20
    assert len(last.refs) + len(last.frames) == 20


def test_a_chain_restore_reuses_a_few_read_buffers(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One ranged read per frame: many reads, each decoded from a reused
    # buffer that held another frame before; every record still comes back
    # as written, from at most the reads in flight plus the one decoded.
    monkeypatch.setattr(referenced, "_MAX_READ", 1)
    monkeypatch.setattr(referenced, "_GAP", 0)
    made: set[int] = set()  # the pool holds every buffer, so ids stay unique
    real = referenced.ReadBuffers.take

    def take(self: referenced.ReadBuffers, size: int) -> bytearray:
        buf = real(self, size)
        made.add(id(buf))
        return buf

    monkeypatch.setattr(referenced.ReadBuffers, "take", take)
    steps = chain(root, 3, n=30, changed=3, gym=False)
    _, refs_only = read_participant(
        steps[-1].location, kind=KIND, instance=INST, checkpoint_id=None
    )
    assert sorted((r.key, r.state) for r in refs_only) == expected(steps[-1])
    assert len(steps[-1].manifest.refs) == 27  # 27 reads
    assert len(made) <= referenced._AHEAD + 1


def test_only_the_changed_records_are_written(root: str) -> None:
    full, inc = chain(root, 2, n=50, changed=5)
    blobs = open_location(root)
    written = {i.key: i.size for i in blobs.list("ck-1")}
    assert written[records_key(inc)] == inc.manifest.bytes
    changed = {f"r{i:03d}" for i in range(5, 10)}
    assert {f.key for f in inc.manifest.frames} == changed
    assert inc.manifest.bytes == len(MAGIC) + sum(f.length for f in inc.manifest.frames)
    assert inc.manifest.bytes < 0.15 * full.manifest.bytes
    assert {r.key for r in inc.manifest.refs} == {r.key for r in full.records} - changed


def test_a_checkpoint_where_nothing_changed_is_still_a_base(root: str) -> None:
    """An idle participant (every record referenced, no frame of its own)
    must not make the checkpoint after it a full rewrite: that one writes
    only what changed since, like any other."""
    first = write(root, "ck-0", [rec(i, 0) for i in range(20)])
    idle = write(root, "ck-1", first.records, first)
    assert idle.manifest.frames == [] and len(idle.manifest.refs) == 20
    changed = [rec(0, 2), *first.records[1:]]
    after = write(root, "ck-2", changed, idle)
    assert [f.key for f in after.manifest.frames] == ["r000"]
    assert {r.checkpoint for r in after.manifest.refs} == {"ck-0"}
    assert restored(after) == expected(after)


def test_unchanged_version_is_referenced_without_encoding(root: str) -> None:
    (full,) = chain(root, 1)
    # Same version, a state the records format cannot even hold: it is never encoded.
    records = [Record(r.key, {"not": {1, 2}}, r.version) for r in full.records]
    inc = write(root, "ck-1", records, full)
    assert len(inc.manifest.refs) == 20
    assert not inc.manifest.frames
    assert restored(inc) == expected(full)


def corrupt(root: str, key: str, at: int) -> None:
    blobs = open_location(root)
    data = bytearray(blobs.read(key))
    data[at] ^= 0xFF
    blobs.replace(key, bytes(data))


def test_a_corrupted_referenced_frame_is_refused_whole(root: str) -> None:
    full, inc = chain(root, 2)
    ref = inc.manifest.refs[-1]
    corrupt(root, records_key(full), ref.offset + ref.length - 5)
    with pytest.raises(InvalidCheckpointState, match=r"digest mismatch in .*ck-0/gym/agent"):
        restored(inc)
    with pytest.raises(InvalidCheckpointState, match="referenced records are corrupt"):
        FileRecordStore().read(inc.location, kind=KIND, instance=INST, select=lambda _k: True)
    report = verify_checkpoint(inc.location)
    assert not report.ok
    assert "corrupt" in (report.participants[0].error or "")


def test_a_missing_referenced_file_is_refused_whole(root: str) -> None:
    full, inc = chain(root, 2)
    open_location(root).delete([records_key(full)])
    name = f"ck-0/{PKEY}/{full.manifest.records_file}"
    with pytest.raises(
        InvalidCheckpointState, match=f"referenced records file .*{name} is missing"
    ):
        restored(inc)
    assert not verify_checkpoint(inc.location).ok


def test_every_kth_checkpoint_is_a_full_rewrite(root: str) -> None:
    steps = chain(root, 4, policy=ChainPolicy(full_every=3))
    assert [s.manifest.chain_depth for s in steps] == [0, 1, 2, 0]
    assert not steps[3].manifest.refs
    assert len(steps[3].manifest.frames) == 20
    assert restored(steps[3]) == expected(steps[3])


def test_few_live_referenced_bytes_make_a_full_rewrite(root: str) -> None:
    (full,) = chain(root, 1)
    # 40 % changed: 60 % of ck-0's bytes stay live, above the 0.5 default.
    some = [rec(i, 1 if i < 8 else 0) for i in range(20)]
    assert write(root, "ck-1", some, full).manifest.chain_depth == 1
    # 60 % changed: only 40 % live, so the whole state is written again.
    most = [rec(i, 1 if i < 12 else 0) for i in range(20)]
    again = write(root, "ck-2", most, full)
    assert again.manifest.chain_depth == 0
    assert not again.manifest.refs
    assert restored(again) == expected(again)


def test_gc_keep_one_keeps_what_the_kept_checkpoint_references(root: str) -> None:
    steps = chain(root, 3)
    blobs = open_location(root)
    cat = scan(blobs)
    assert cat.checkpoints["ck-0"].entry.referenced_by == ["ck-1", "ck-2"]
    collect(blobs, 1)
    left = {i.key for i in blobs.list()}
    assert records_key(steps[0]) in left
    assert records_key(steps[1]) in left
    assert f"ck-0/{PKEY}/manifest.json" not in left
    assert restored(steps[2]) == expected(steps[2])
    assert verify_checkpoint(steps[2].location).ok


def test_a_previous_that_is_unsafe_to_reference_makes_a_full_checkpoint(
    root: str, tmp_path: pathlib.Path
) -> None:
    (full,) = chain(root, 1)
    records = [rec(i, 1 if i == 0 else 0) for i in range(20)]
    # Another root: not a sibling.
    other = str(tmp_path / "other-root")
    assert not write(other, "ck-1", records, full).manifest.refs
    # The manifest committed differs from the one the caller says it committed.
    twin = write(root, "ck-twin", [rec(i, 5) for i in range(20)])
    fake = Step(full.location, twin.manifest, full.records)
    assert not write(root, "ck-2", records, fake).manifest.refs
    # A manifest without a frame index (written before incremental checkpoints).
    bare = Step(full.location, _without_index(full.manifest), full.records)
    assert not write(root, "ck-3", records, bare).manifest.refs
    # The previous one is gone.
    open_location(root).delete([f"ck-0/{PKEY}/manifest.json"])
    assert not write(root, "ck-4", records, full).manifest.refs


def _without_index(m: ParticipantManifest) -> ParticipantManifest:
    import msgspec

    return msgspec.structs.replace(m, frames=[])


def test_a_retried_incremental_commit_returns_the_same_manifest(root: str) -> None:
    full, inc = chain(root, 2, gym=False)
    again = write(root, "ck-1", inc.records, full, gym=False)
    assert again.manifest == inc.manifest
    files = [i.key for i in open_location(root).list("ck-1") if "records-" in i.key]
    assert len(files) == 1
    changed = [Record(r.key, {"other": 1}, "9") for r in inc.records]
    with pytest.raises(InvalidCheckpointState, match="already holds a different commit"):
        write(root, "ck-1", changed, full, gym=False)


def test_the_store_references_its_last_complete_commit_only(root: str) -> None:
    store = FileRecordStore()

    def commit(name: str, gen: int, gym: bool = True) -> ParticipantManifest:
        where = join_location(root, name)
        records = [rec(i, gen if i == 0 else 0) for i in range(20)]
        m: ParticipantManifest = store.write(
            where,
            kind=KIND,
            instance=INST,
            checkpoint_id=f"c-{name}",
            records=records,
            stop=store.new_stop(),
        )
        if gym:
            write_gym_manifest(where, checkpoint_id=f"c-{name}", manifests=[m])
        return m

    assert not commit("ck-0", 0).refs
    assert len(commit("ck-1", 1, gym=False).refs) == 19
    # ck-1 never completed: the one before it is the base.
    assert {r.checkpoint for r in commit("ck-2", 2).refs} == {"ck-0"}
    assert len(commit("ck-3", 3, gym=False).refs) == 19
    assert len(commit("ck-4", 4, gym=False).refs) == 19
    # Neither remembered commit completed: a full one.
    assert not commit("ck-5", 5).refs
    assert {r.checkpoint for r in commit("ck-6", 6).refs} == {"ck-5"}


def test_full_every_one_turns_references_off(root: str) -> None:
    store = FileRecordStore(full_every=1)
    for c in range(2):
        where = join_location(root, f"ck-{c}")
        m = store.write(
            where,
            kind=KIND,
            instance=INST,
            checkpoint_id=f"c{c}",
            records=[rec(i, 0) for i in range(5)],
            stop=store.new_stop(),
        )
        write_gym_manifest(where, checkpoint_id=f"c{c}", manifests=[m])
        assert not m.refs
        assert not m.frames  # nothing will reference them: no index is kept


def test_settings_bound_the_chain() -> None:
    from pydantic import ValidationError

    from ray_ckpt.settings import CheckpointSettings

    s = CheckpointSettings()
    assert (s.incremental_full_every, s.incremental_min_live_fraction) == (8, 0.5)
    with pytest.raises(ValidationError):
        CheckpointSettings(incremental_full_every=0)
    with pytest.raises(ValidationError):
        CheckpointSettings(incremental_min_live_fraction=1.5)


def test_inspect_follows_references(root: str) -> None:
    from coordination.cli.inspect import inspect_checkpoint, render_inspect

    full, inc = chain(root, 2)
    report = inspect_checkpoint(inc.location)
    assert report.ok
    (row,) = report.rows
    assert (row.referenced, row.references, row.episodes) == (18, ["ck-0"], 20)
    assert "18 in ck-0" in render_inspect(report, width=200)
    ref = inc.manifest.refs[0]
    corrupt(root, records_key(full), ref.offset + FRAME_HEAD)
    bad = inspect_checkpoint(inc.location)
    assert not bad.ok
    assert "referenced records are corrupt" in (bad.rows[0].error or "")


FRAME_HEAD = 10  # inside the frame header + key: any byte of the frame is covered


def test_a_manifest_of_the_old_shape_reads_and_is_never_a_base(root: str) -> None:
    import msgspec

    where = join_location(root, "ck-0")
    records = [rec(i, 0) for i in range(5)]
    m = write_participant(
        where, kind=KIND, instance=INST, checkpoint_id="c0", records=records, frame_index=False
    )
    raw = msgspec.json.decode(open_location(where).read(f"{PKEY}/manifest.json"))
    assert not {"frames", "refs", "chain_depth"} & set(raw)  # byte-for-byte the old shape
    old = Step(where, m, records)
    assert restored(old) == expected(old)
    assert not write(root, "ck-1", records, old).manifest.refs


def test_a_stop_during_the_change_check_publishes_nothing(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ray_ckpt.storage import WriteStop
    from ray_ckpt.storage.participant import incremental

    (full,) = chain(root, 1, versioned=False)
    stop = WriteStop()
    real = incremental.StateEncoder.frame
    seen: list[str] = []

    def frame(self: Any, key: str, state: Any) -> tuple[bytes, bytes]:
        seen.append(key)
        stop.stop()  # a resume arrives while the first state is compared
        return real(self, key, state)

    monkeypatch.setattr(incremental.StateEncoder, "frame", frame)
    with pytest.raises(InvalidCheckpointState, match="write stopped"):
        write(root, "ck-1", full.records, full, stop=stop)
    assert seen == ["r000"]  # the check stopped at the next record, not after all of them
    assert not open_location(root).list("ck-1")
