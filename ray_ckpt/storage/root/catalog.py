"""The checkpoints under a root: listing, completeness, `latest`.

A root holds one checkpoint per top-level name, ``<root>/<name>/``, and the
Gym part of each lives under ``<name>/gym/`` (the trainer may keep its own
files beside it; nothing here reads or deletes them), plus the `LATEST`
pointer (`ray_ckpt.storage.root.pointer`).  `latest` is the checkpoint `LATEST`
names when it is complete, else the newest complete one by time: a crash
between the Gym manifest and the pointer leaves a complete checkpoint that
`LATEST` does not name yet.

Complete means a verifiable Gym manifest: it decodes, every participant
manifest it lists is there with the digest it records, each names a
records object of the size listed, and every key it needs (`needed_keys`:
referenced records, attachment blobs) is in the listing.  Records and blobs
are not re-hashed here (a listing must stay cheap on object storage); a
restore verifies every byte it uses, a verify every byte.

Everything goes through `Blobs`, so a root on disk and one in a bucket are
listed the same way.  `needed_keys` is the single answer to "which keys must
stay for this checkpoint to restore": the listing's "referenced by" column and
garbage collection both use it, so a checkpoint that references another's
files (incremental records, attachment blobs) only has to extend that one
function.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
from collections.abc import Mapping
from typing import Any

import msgspec

from ray_ckpt.errors import CheckpointError, InvalidCheckpointState
from ray_ckpt.identity import is_result_key
from ray_ckpt.storage.blobstore.blobs import BlobInfo, BlobMissing, Blobs, is_temp
from ray_ckpt.storage.blobstore.locations import join_location
from ray_ckpt.storage.participant.attachments import blob_needs, own_blob_bytes
from ray_ckpt.storage.participant.incremental import referenced_files
from ray_ckpt.storage.participant.participant_store import MANIFEST_NAME, SCHEMA_VERSION
from ray_ckpt.storage.root.gym_manifest import GYM_MANIFEST_NAME, GymManifest
from ray_ckpt.storage.root.pointer import LatestPointer, read_latest

log = logging.getLogger(__name__)

GYM = "gym"
_READERS = 16


class CheckpointEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One row of `ray-ckpt list` (its JSON has exactly these fields)."""

    name: str
    checkpoint_id: str | None
    # When the Gym manifest was written (its own `written_at`, else the
    # listing's time); the newest write if incomplete.
    time: float
    participants: int
    episodes: int
    # The checkpoint's size as every command reports it: its participants'
    # records as the Gym manifest lists them and the attachment blobs they
    # hold themselves (`blob_bytes`; referenced ones count where they are
    # held); incomplete: every object.
    bytes: int
    complete: bool
    referenced_by: list[str]
    stored_bytes: int = 0  # every object under <name>/gym/ (manifests too)


class Scanned(msgspec.Struct, frozen=True, kw_only=True):
    """What one checkpoint holds, beyond its row: for `latest` and gc."""

    entry: CheckpointEntry
    keys: list[BlobInfo]  # every object under <name>/gym/
    needs: frozenset[str]  # keys it cannot restore without (`needed_keys`)
    episode_keys: list[str] | None  # capture keys; None if a manifest lists none
    problem: str | None  # why it is not complete
    # "<kind>/<instance>" → the keys its participant manifest needs
    # (`participant_needs`), for each participant manifest that could be read,
    # complete or not: gc keeps what an in-flight checkpoint will need.
    parts: dict[str, frozenset[str]] = msgspec.field(default_factory=dict)


class Catalog(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    checkpoints: dict[str, Scanned]
    latest: LatestPointer | None
    root_keys: list[BlobInfo]  # objects outside any <name>/gym/ (LATEST, probes)

    @property
    def entries(self) -> list[CheckpointEntry]:
        """Oldest first (by time, then name)."""
        return [s.entry for s in sorted(self.checkpoints.values(), key=_order)]

    def complete(self) -> list[Scanned]:
        """Complete checkpoints, newest first."""
        done = [s for s in self.checkpoints.values() if s.entry.complete]
        return sorted(done, key=_order, reverse=True)


def _order(s: Scanned) -> tuple[float, str]:
    """Oldest first.  By time: the Gym manifest's own `written_at`, precise,
    where the listing's time is whole seconds on S3 (by name alone,
    `step-10` would sort before `step-9`); the name only breaks a true tie."""
    return (s.entry.time, s.entry.name)


# --- what a checkpoint needs --------------------------------------------------


def needed_keys(
    name: str, gym: GymManifest, manifests: Mapping[tuple[str, str], Mapping[str, Any]]
) -> frozenset[str]:
    """Every key checkpoint `name` needs to restore: its Gym manifest, each
    participant manifest, each records object those manifests name, each
    earlier checkpoint's records object an incremental manifest references
    (`incremental.referenced_files`; always in the participant's own folder
    of a sibling checkpoint), and every attachment blob a manifest lists,
    its own or a sibling's (`attachments.blob_needs`)."""
    keys = {f"{name}/{GYM}/{GYM_MANIFEST_NAME}"}
    for e in gym.participants:
        keys |= participant_needs(name, e.kind, e.instance, manifests[(e.kind, e.instance)])
    return frozenset(keys)


def participant_needs(name: str, kind: str, instance: str, m: Mapping[str, Any]) -> frozenset[str]:
    """The keys one participant manifest of checkpoint `name` needs: itself,
    the records object it names, each earlier records object it references,
    and each attachment blob it lists (wherever it is held)."""
    pdir = f"{name}/{GYM}/{kind}/{instance}"
    keys = {f"{pdir}/{MANIFEST_NAME}"}
    records = m.get("records_file")
    if isinstance(records, str):
        keys.add(f"{pdir}/{records}")
    for checkpoint, records_file in referenced_files(m):
        keys.add(f"{checkpoint}/{GYM}/{kind}/{instance}/{records_file}")
    keys |= blob_needs(name, f"{GYM}/{kind}/{instance}", m)
    return frozenset(keys)


def participant_of(key: str) -> str | None:
    """The "<kind>/<instance>" of a key under ``<name>/gym/<kind>/<instance>/``."""
    parts = key.split("/")
    return f"{parts[2]}/{parts[3]}" if len(parts) >= 5 and parts[1] == GYM else None


# --- scanning -----------------------------------------------------------------


def scan(blobs: Blobs) -> Catalog:
    """List and check every checkpoint under the root (one listing, then the
    manifests: no records are read)."""
    by_name: dict[str, list[BlobInfo]] = {}
    outside: list[BlobInfo] = []
    for info in blobs.list():
        name, _, rest = info.key.partition("/")
        if rest.startswith(f"{GYM}/"):
            by_name.setdefault(name, []).append(info)
        else:
            outside.append(info)
    # Each checkpoint costs a few small reads: on an object store those are
    # round trips, so checkpoints are read side by side, not one by one.
    with concurrent.futures.ThreadPoolExecutor(max_workers=_READERS) as pool:
        scanned = pool.map(lambda item: _scan_one(blobs, *item), by_name.items())
        found = {s.entry.name: s for s in scanned}
    # Complete also means every file it needs elsewhere is there: an incremental
    # checkpoint whose earlier records were deleted (by hand, by another tool)
    # would otherwise be listed complete and picked as `latest`, and fail only
    # at restore.
    present = {i.key for infos in by_name.values() for i in infos}
    found = {n: _missing_needs(s, present) for n, s in found.items()}
    # A key inside another checkpoint that one needs makes it "referenced by" that one.
    referenced: dict[str, set[str]] = {n: set() for n in found}
    for name, s in found.items():
        for key in s.needs:
            owner = key.partition("/")[0]
            if owner != name and owner in referenced:
                referenced[owner].add(name)
    done = {
        n: msgspec.structs.replace(
            s, entry=msgspec.structs.replace(s.entry, referenced_by=sorted(referenced[n]))
        )
        for n, s in found.items()
    }
    return Catalog(url=blobs.url, checkpoints=done, latest=read_latest(blobs), root_keys=outside)


def _missing_needs(s: Scanned, present: set[str]) -> Scanned:
    missing = sorted(s.needs - present) if s.entry.complete else []
    if not missing:
        return s
    problem = f"{len(missing)} file(s) it needs are missing, e.g. {missing[0]}: incomplete"
    return msgspec.structs.replace(
        s,
        entry=msgspec.structs.replace(s.entry, complete=False),
        needs=frozenset(),  # nothing restores from it (as for any incomplete one)
        problem=problem,
    )


def scan_one(blobs: Blobs, name: str) -> Scanned:
    """One checkpoint of the root (`InvalidCheckpointState` if it holds nothing)."""
    keys = blobs.list(f"{name}/{GYM}")
    if not keys:
        raise InvalidCheckpointState(f"no checkpoint {name!r} under {blobs.url}")
    return _scan_one(blobs, name, keys)


def _scan_one(blobs: Blobs, name: str, keys: list[BlobInfo]) -> Scanned:
    sizes = {i.key: i for i in keys if not is_temp(i.key)}
    total = sum(i.size for i in keys)
    gym_key = f"{name}/{GYM}/{GYM_MANIFEST_NAME}"
    try:
        if gym_key not in sizes:
            raise InvalidCheckpointState("no Gym manifest: incomplete")
        gym, manifests = _verified(blobs, name, sizes)
    except CheckpointError as exc:
        return _incomplete(blobs, name, keys, sizes, total, exc.detail)
    episodes = _episode_keys(manifests.values())
    entry = CheckpointEntry(
        name=name,
        checkpoint_id=gym.checkpoint_id,
        time=gym.written_at if gym.written_at is not None else sizes[gym_key].modified,
        participants=len(gym.participants),
        episodes=len(episodes) if episodes is not None else _max_count(manifests.values()),
        bytes=sum(e.bytes for e in gym.participants)
        + sum(own_blob_bytes(m) for m in manifests.values()),
        stored_bytes=total,
        complete=True,
        referenced_by=[],
    )
    return Scanned(
        entry=entry,
        keys=keys,
        needs=needed_keys(name, gym, manifests),
        episode_keys=episodes,
        problem=None,
        parts={f"{k}/{i}": participant_needs(name, k, i, m) for (k, i), m in manifests.items()},
    )


def _verified(
    blobs: Blobs, name: str, sizes: Mapping[str, BlobInfo]
) -> tuple[GymManifest, dict[tuple[str, str], dict[str, Any]]]:
    gym_key = f"{name}/{GYM}/{GYM_MANIFEST_NAME}"
    try:
        gym = msgspec.json.decode(blobs.read(gym_key), type=GymManifest)
    except msgspec.DecodeError as exc:
        raise InvalidCheckpointState(f"corrupt Gym manifest: {exc}") from None
    if gym.schema_version != SCHEMA_VERSION:
        raise InvalidCheckpointState(f"unknown Gym manifest schema {gym.schema_version}")
    manifests: dict[tuple[str, str], dict[str, Any]] = {}
    for e in gym.participants:
        pdir = f"{name}/{GYM}/{e.kind}/{e.instance}"
        data = blobs.read(f"{pdir}/{MANIFEST_NAME}")
        if hashlib.sha256(data).hexdigest() != e.manifest_digest:
            raise InvalidCheckpointState(f"{pdir}/{MANIFEST_NAME} does not match its digest")
        m = _json_object(data)
        if m is None:
            raise InvalidCheckpointState(f"{pdir}/{MANIFEST_NAME} is not a JSON object")
        records = m.get("records_file")
        info = sizes.get(f"{pdir}/{records}") if isinstance(records, str) else None
        if info is None or info.size != e.bytes:
            raise InvalidCheckpointState(f"records of {e.kind}/{e.instance} missing or resized")
        manifests[(e.kind, e.instance)] = m
    return gym, manifests


def _incomplete(
    blobs: Blobs,
    name: str,
    keys: list[BlobInfo],
    sizes: Mapping[str, BlobInfo],
    total: int,
    problem: str,
) -> Scanned:
    """What an incomplete checkpoint shows: the participant manifests it has."""
    manifests = []
    parts: dict[str, frozenset[str]] = {}
    for key in sizes:
        if key.endswith(f"/{MANIFEST_NAME}") and key.count("/") == 4:
            try:
                m = _json_object(blobs.read(key))
            except BlobMissing:
                m = None
            if m is not None:
                manifests.append(m)
                _, _, kind, instance, _ = key.split("/")
                parts[f"{kind}/{instance}"] = participant_needs(name, kind, instance, m)
    ids = {m.get("checkpoint_id") for m in manifests}
    cid = ids.pop() if len(ids) == 1 else None
    episodes = _episode_keys(manifests)
    entry = CheckpointEntry(
        name=name,
        checkpoint_id=cid if isinstance(cid, str) else None,
        time=max(i.modified for i in keys),
        participants=len(manifests),
        episodes=len(episodes) if episodes is not None else _max_count(manifests),
        bytes=total,
        stored_bytes=total,
        complete=False,
        referenced_by=[],
    )
    # Nothing restores from it, so it needs nothing; gc still keeps a young one
    # and what its participants reference (`parts`).
    return Scanned(
        entry=entry,
        keys=keys,
        needs=frozenset(),
        episode_keys=None,
        problem=problem,
        parts=parts,
    )


def _json_object(data: bytes) -> dict[str, Any] | None:
    try:
        obj = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def _episode_keys(manifests: Any) -> list[str] | None:
    """The capture keys of the episodes the manifests list (ours do; NeMo
    Gym's do not: None).  A held result (`result:<key>`, completion receipts)
    is a record too, but a finished one: not an episode a restore continues."""
    keys: set[str] = set()
    for m in manifests:
        listed = m.get("episodes")
        if not isinstance(listed, list):
            return None
        keys.update(k for k in listed if isinstance(k, str) and not is_result_key(k))
    return sorted(keys)


def _max_count(manifests: Any) -> int:
    counts = [m.get("record_count") for m in manifests]
    return max((c for c in counts if isinstance(c, int)), default=0)


# --- latest -------------------------------------------------------------------


def pick_latest(catalog: Catalog) -> Scanned:
    """`LATEST` if it names a complete checkpoint, else the newest complete one
    by time; `InvalidCheckpointState` if there is none."""
    pointer = catalog.latest
    if pointer is not None:
        named = catalog.checkpoints.get(pointer.name)
        if (
            named is not None
            and named.entry.complete
            and named.entry.checkpoint_id == pointer.checkpoint_id
        ):
            return named
    done = catalog.complete()
    if not done:
        raise InvalidCheckpointState(f"no complete checkpoint under {catalog.url}")
    return done[0]


def latest_location(root: str | os.PathLike[str], blobs: Blobs) -> tuple[str, Scanned]:
    """(location of the checkpoint `latest` picks under `root`, its scan)."""
    picked = pick_latest(scan(blobs))
    return join_location(os.fspath(root), picked.entry.name), picked
