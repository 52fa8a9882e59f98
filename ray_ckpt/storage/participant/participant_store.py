"""One participant's checkpoint: streamed records, its attachments' blobs, then its manifest.

Layout under ``<location>/gym/<kind>/<instance>/``:

- ``records-<token>.msgpack``: the records (`records_format`);
- ``blobs/<digest>``: one object per distinct attachment digest of the
  records (`Record.attachments`, BLAKE3 hex; `attachments`), only when some
  record has attachments;
- ``manifest.json`` (`participant_manifest`).

The manifest is the commit point: it is created last and never replaced,
so no manifest means "not committed", and a manifest always names a
complete records object and blobs that were verified as they were stored.

How the disk steps map onto an object store (the `Blobs` backends keep them):

- the records are streamed into a temp file that is fsynced and then
  hard-linked to its name; on a store they go up as a multipart upload that
  only `CompleteMultipartUpload` makes visible, whole.  A crash before that
  leaves a temp file (disk) or an incomplete upload (store, invisible to
  readers and listings), never a partial object under the final name;
- the manifest is created with a create-only hard link and a directory
  fsync on disk, with a conditional put (`If-None-Match: *`) on a store: of
  two writers exactly one creates it, and the other learns what is there;
- the records name must be fixed before a multipart upload starts, so it is
  a fresh random token, not the digest (the manifest keeps the digest).  A
  fresh name never collides, so the upload needs no create-only guarantee;
  older digest-named files are still read.

Reads verify the digest, size and count over the whole object in one
streaming pass and decode only the records the caller keeps.  The digest is
made of the frames' own digests (`records_format`, BLAKE3), so a commit
hashes its bytes once; manifests from before ("sha256-frames", "sha256")
are verified with the digest they name.

Incremental (`incremental`, `referenced`): given the previous commit, the
records object holds only the changed records and the manifest references
the rest in earlier records objects; a read verifies those frames too, and
returns nothing unless all of them pass.  Blobs the previous commit already
stores are referenced the same way (by the checkpoint holding the object),
the others written.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterable

import msgspec

from ray_ckpt.errors import InvalidCheckpointState
from ray_ckpt.storage.blobstore.blobs import BlobMissing, Blobs, blob_name
from ray_ckpt.storage.blobstore.durable import WriteStop
from ray_ckpt.storage.participant.attachments import Collected, attach, by_record, store_blobs
from ray_ckpt.storage.participant.incremental import ChainPolicy, Previous, plan, same_records
from ray_ckpt.storage.participant.participant_manifest import (
    DIGEST_ALGO,
    MANIFEST_NAME,
    RECORDS_RE,
    SCHEMA_VERSION,
    Frame,
    ParticipantManifest,
    Where,
    blobs_of,
    check_name,
    decode_manifest,
    encode_manifest,
    load_manifest,
    manifest_bytes,
    participant_dir,
    participant_key,
)
from ray_ckpt.storage.participant.referenced import RefReader
from ray_ckpt.storage.records.pipeline import ChunkWriter, HashingReader
from ray_ckpt.storage.records.record import Record
from ray_ckpt.storage.records.records_format import FORMAT, WHOLE_FILE_DIGEST
from ray_ckpt.storage.records.records_io import (
    FrameIndex,
    digest_records,
    encode_records,
    parse_records,
)

__all__ = [
    "DIGEST_ALGO",
    "MANIFEST_NAME",
    "RECORDS_RE",
    "SCHEMA_VERSION",
    "ChainPolicy",
    "ParticipantManifest",
    "Previous",
    "check_name",
    "decode_manifest",
    "encode_manifest",
    "load_manifest",
    "manifest_bytes",
    "participant_dir",
    "participant_key",
    "read_participant",
    "read_records",
    "write_participant",
]


def write_participant(
    checkpoint_dir: Where,
    *,
    kind: str,
    instance: str,
    checkpoint_id: str,
    records: Iterable[Record],
    stop: WriteStop | None = None,
    previous: Previous | None = None,
    policy: ChainPolicy | None = None,
    frame_index: bool = True,
) -> ParticipantManifest:
    """Stream the records, then create the manifest; return it.

    With `previous` (the location and returned manifest of this
    participant's last commit, a sibling under the same root), only records
    that changed are written and the rest referenced (`incremental`); without
    it, or when `policy` calls for a full rewrite, every record is written.
    `frame_index` lists in the manifest where each frame sits and its
    digest (computed either way: they make the file's digest), which a later
    checkpoint needs to reference them; without it the next one is full.
    An identical recommit returns the existing manifest; a different commit
    into the same place raises `InvalidCheckpointState`.

    Records' attachments are stored as blobs before the manifest, each
    verified against its digest as it streams (`attachments.store_blobs`);
    a source that does not match fails the write and nothing is published
    under its name, nor any manifest.
    """
    stop = stop or WriteStop()
    if previous is not None:
        records = list(records)  # looked at twice: the change check, then the write
    if not isinstance(checkpoint_id, str) or not checkpoint_id:
        raise InvalidCheckpointState(f"bad checkpoint id {checkpoint_id!r}")
    blobs = blobs_of(checkpoint_dir)
    pkey = participant_key(kind, instance)
    stop.check()
    prior: ParticipantManifest | None = None
    with contextlib.suppress(InvalidCheckpointState):  # absent or unreadable: decided at create
        prior = load_manifest(blobs, kind=kind, instance=instance, checkpoint_id=None)
    if prior is not None:
        return _recommit(blobs, prior, checkpoint_id, records, stop)
    chosen = None
    if previous is not None:
        assert isinstance(records, list)
        chosen = plan(
            blobs,
            kind=kind,
            instance=instance,
            checkpoint_id=checkpoint_id,
            records=records,
            previous=previous,
            policy=policy or ChainPolicy(),
            stop=stop,
        )
    refs = chosen.refs if chosen is not None else {}
    attachments = Collected()
    records_file = f"records-{uuid.uuid4().hex}.msgpack"
    rkey = f"{pkey}/{records_file}"
    with contextlib.ExitStack() as publishing:
        # The stop lock is taken once the records are stored, just before they
        # become visible, and held until the manifest is created: after
        # `stop()` returns, neither appears.
        # The records' name is made durable by the manifest's directory fsync
        # (same folder, `sync_name`): three fsyncs per commit, not four.
        with blobs.upload(
            rkey,
            before_publish=lambda: publishing.enter_context(stop.publishing()),
            sync_name=False,
        ) as up:
            writer = ChunkWriter(up.write)
            # The frame digests make the file's digest.
            index = FrameIndex(thread=False, algo=DIGEST_ALGO)
            try:
                keys = encode_records(
                    writer,
                    attachments.reading(records),
                    stop,
                    index=index,
                    skip=refs,
                    encoded=chosen.encoded if chosen is not None else None,
                )
            finally:
                try:
                    writer.close()
                finally:
                    index.close()
            digest = index.file_digest()
            # Inside the records' upload: a blob that fails leaves no records
            # object either, and every blob is stored before the manifest.
            blob_refs = store_blobs(
                blobs,
                pkey,
                checkpoint_id=checkpoint_id,
                sources=attachments.sources,
                refs=chosen.blobs if chosen is not None else {},
                stop=stop,
            )
        manifest = ParticipantManifest(
            schema_version=SCHEMA_VERSION,
            checkpoint_id=checkpoint_id,
            kind=kind,
            instance=instance,
            records_file=records_file,
            digest_algo=DIGEST_ALGO,
            digest=digest,
            record_count=len(keys),
            episodes=sorted(keys),
            bytes=writer.size,
            format=FORMAT,
            frames=[
                Frame(key, offset, length, frame_digest, version)
                for (key, offset, length, version), frame_digest in zip(
                    index.spans, index.digests, strict=True
                )
            ]
            if frame_index
            else [],
            refs=[refs[k] for k in sorted(refs)],
            chain_depth=chosen.depth if chosen is not None else 0,
            attachments=dict(sorted(attachments.by_record.items())),
            blobs=blob_refs,
            blob_bytes=sum(b.bytes for b in blob_refs if b.checkpoint == checkpoint_id),
        )
        # No clean-up if this raises: the manifest may be published all the
        # same (a failing directory fsync after the link), naming the records.
        existing = blobs.create(f"{pkey}/{MANIFEST_NAME}", encode_manifest(manifest))
    if existing is None:
        return manifest
    # Lost the manifest race to another writer (a participant misconfigured
    # with the same kind and instance).  Our records object has a fresh name
    # no manifest can name, so it goes either way.
    _discard(blobs, rkey)
    other = decode_manifest(existing, blob_name(blobs, f"{pkey}/{MANIFEST_NAME}"))
    if _same_content(other, manifest):
        return other
    raise _conflict(blobs, pkey, other)


def _recommit(
    blobs: Blobs,
    prior: ParticipantManifest,
    checkpoint_id: str,
    records: Iterable[Record],
    stop: WriteStop,
) -> ParticipantManifest:
    """A manifest is already there: the same commit again returns it, anything
    else is refused.  Only hashed (nothing is written), so a retried commit
    leaves no second records object."""
    pkey = participant_key(prior.kind, prior.instance)
    if prior.checkpoint_id != checkpoint_id:
        raise _conflict(blobs, pkey, prior)  # fail fast, before encoding anything
    records = list(records)
    if by_record(records) != prior.attachments:
        raise _conflict(blobs, pkey, prior)
    if prior.frames or prior.refs:
        if not same_records(prior, records, stop):
            raise _conflict(blobs, pkey, prior)
        return prior
    digest, size, keys = digest_records(records, stop, algo=prior.digest_algo)
    stop.check()
    same = (digest, size, sorted(keys)) == (prior.digest, prior.bytes, prior.episodes)
    if not same:
        raise _conflict(blobs, pkey, prior)
    return prior


def _same_content(a: ParticipantManifest, b: ParticipantManifest) -> bool:
    """Equal but for the records object's name (each writer picks its own)."""
    return a == msgspec.structs.replace(b, records_file=a.records_file)


def _discard(blobs: Blobs, key: str) -> None:
    with contextlib.suppress(Exception):  # best effort: an orphan is only garbage
        blobs.delete([key])


def _conflict(blobs: Blobs, pkey: str, other: ParticipantManifest) -> InvalidCheckpointState:
    return InvalidCheckpointState(
        f"{blob_name(blobs, pkey)} already holds a different commit (checkpoint "
        f"{other.checkpoint_id!r}, digest {other.digest[:12]}); a manifest is never replaced"
    )


def read_participant(
    checkpoint_dir: Where,
    *,
    kind: str,
    instance: str,
    checkpoint_id: str | None,
    select: Callable[[str], bool] | None = None,
    attachments_dir: str | None = None,
) -> tuple[ParticipantManifest, list[Record]]:
    """Verify one participant's whole records object; return the records
    `select` keeps, with their attachments (`read_records`)."""
    blobs = blobs_of(checkpoint_dir)
    manifest = load_manifest(blobs, kind=kind, instance=instance, checkpoint_id=checkpoint_id)
    return manifest, read_records(blobs, manifest, select, attachments_dir=attachments_dir)


def read_records(
    checkpoint_dir: Where,
    manifest: ParticipantManifest,
    select: Callable[[str], bool] | None = None,
    *,
    attachments_dir: str | None = None,
) -> list[Record]:
    """Verify the whole records object a loaded manifest names, and every
    frame it references in earlier files (`referenced`); the records
    `select` keeps (own and referenced, in the manifest's key order).

    Each kept record's `attachments` map its digests to verified local
    files, fetched for the kept records only (`attachments.attach`): on a
    local disk the blob objects themselves (never to be changed); from an
    object store, downloads into `attachments_dir`, or into a new temporary
    folder when it is None, which the caller then owns and removes (its path
    is the parent of any attachment path).  A blob that is missing or
    corrupt fails the read whole."""
    blobs = blobs_of(checkpoint_dir)
    if not manifest.refs:
        records = _read_own(blobs, manifest, select)
    else:
        # The referenced frames are fetched while the own file is verified, and
        # nothing is returned unless every one is: the restore fails whole.
        with RefReader(blobs, manifest) as refs:
            got = {r.key: r for r in _read_own(blobs, manifest, select)}
            got |= refs.records(select)
        records = [got[k] for k in manifest.episodes if k in got]
    if not manifest.attachments:
        return records
    return attach(blobs, manifest, records, attachments_dir)


def _read_own(
    blobs: Blobs, manifest: ParticipantManifest, select: Callable[[str], bool] | None
) -> list[Record]:
    key = f"{participant_key(manifest.kind, manifest.instance)}/{manifest.records_file}"
    name = blob_name(blobs, key)
    # Every byte is verified either way: the magic as it is, each frame by
    # its own hash (which the digest is made of); files written before
    # the frames digest, by one hash of the whole file.
    whole_file = manifest.digest_algo == WHOLE_FILE_DIGEST
    try:
        reader = HashingReader(blobs.stream(key), hash=whole_file)
    except BlobMissing:
        raise InvalidCheckpointState(f"records file {name} is missing") from None
    index = None if whole_file else FrameIndex(thread=False, algo=manifest.digest_algo)
    try:
        keys, kept, problem = parse_records(reader, select, index)
        if problem is not None:
            reader.drain()
    finally:
        try:
            digest = reader.close()
        finally:
            if index is not None:
                index.close()
    if index is not None:
        digest = index.file_digest()
    if reader.size != manifest.bytes:
        raise InvalidCheckpointState(
            f"truncated or extended records {name}: {reader.size} bytes, manifest says "
            f"{manifest.bytes}"
        )
    if digest != manifest.digest:
        raise InvalidCheckpointState(f"digest mismatch in {name}: records are corrupt")
    if problem is not None:
        raise InvalidCheckpointState(f"corrupt records {name}: {problem}")
    keys += [r.key for r in manifest.refs]
    if len(keys) != manifest.record_count or sorted(keys) != manifest.episodes:
        raise InvalidCheckpointState(
            f"records {name} hold {len(keys)} episodes, manifest lists {manifest.record_count}"
        )
    return kept
