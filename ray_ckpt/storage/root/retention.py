"""Retention: which checkpoints under a root to delete, and deleting them.

`plan_retention` is pure: from a `Catalog` and the time it decides, and
`apply_plan` only carries the plan out.  The rules, each a guarantee:

- the `keep` newest complete checkpoints stay, and so does the one `LATEST`
  names; an older complete one goes only once `keep` newer ones are complete,
  so an incomplete newest never costs the last complete one;
- an incomplete checkpoint goes only if a newer complete one exists and it
  has not been written to for `grace_s` (a crash left it); a young or newest
  one may be a write in flight and stays;
- a key a kept checkpoint needs (`catalog.needed_keys`: its own files, and
  the earlier records and the attachment blobs it references) is never
  deleted, whichever checkpoint's folder it sits in; a deleted checkpoint's
  blobs go with it unless a kept one references them;
- an incomplete checkpoint kept as possibly in flight keeps what its
  incremental writes will need too (`in_flight_needs`): the earlier records
  and blobs its participant manifests reference, and for a participant whose
  manifest is not written yet the files (records and blobs) of the newest
  complete checkpoint it is in (the base an incremental write picks,
  `storage.seam`);
- temp objects (`blobs.is_temp`) older than `grace_s` are collected, in kept
  checkpoints too: a write in flight is younger than that, crash leftovers are
  not;
- only what ray-ckpt wrote is deleted (keys under ``<name>/gym/`` and temp
  objects at the root), never the trainer's files beside them.

Deletes go to `Blobs.delete` in one batched call, not one request per key.
"""

from __future__ import annotations

import contextlib
import os
import time

import msgspec

from ray_ckpt.errors import InvalidRequest
from ray_ckpt.storage.blobstore.blobs import BlobInfo, Blobs, is_temp
from ray_ckpt.storage.root.catalog import GYM, Catalog, Scanned, participant_of, scan

# A write in flight touches its temp object at least this often; anything
# quieter for longer is a crash's leftover.  Generous: a commit of a large
# state on a slow store can sit in one multipart part for minutes.
DEFAULT_GRACE_S = 3600.0


class PlanRow(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # a checkpoint, or "(temp)" for the collected temp objects
    action: str  # "keep" | "delete" | "collect"
    reason: str
    keys: int  # objects deleted (0 when kept)
    bytes: int


class GcPlan(msgspec.Struct, frozen=True, kw_only=True):
    location: str
    keep: int
    grace_s: float
    dry_run: bool
    rows: list[PlanRow]
    delete: list[str]  # every key the plan deletes, sorted
    bytes: int
    deleted: bool = False  # set once `apply_plan` carried it out

    @property
    def deleted_checkpoints(self) -> list[str]:
        return [r.name for r in self.rows if r.action == "delete"]


def plan_retention(catalog: Catalog, keep: int, *, now: float, grace_s: float) -> GcPlan:
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise InvalidRequest(f"keep must be an integer >= 1 (got {keep!r})")
    if grace_s < 0:
        raise InvalidRequest(f"the temp-file grace period must be >= 0 (got {grace_s!r})")
    done = catalog.complete()
    kept: dict[str, str] = {s.entry.name: f"among the {keep} newest complete" for s in done[:keep]}
    if catalog.latest is not None and catalog.latest.name in {s.entry.name for s in done}:
        kept.setdefault(catalog.latest.name, "named by LATEST")
    newest = done[0].entry.time if done else None
    gone: dict[str, str] = {}
    for s in catalog.checkpoints.values():
        name = s.entry.name
        if name in kept:
            continue
        if s.entry.complete:
            gone[name] = f"{keep} newer complete checkpoints exist"
        elif newest is None or s.entry.time >= newest:
            kept[name] = "incomplete, newer than every complete one (may be in flight)"
        elif now - s.entry.time < grace_s:
            kept[name] = f"incomplete, written to within {grace_s:g}s (may be in flight)"
        else:
            gone[name] = "incomplete and abandoned (a newer one is complete)"
    protected: set[str] = set()
    for name in kept:
        s = catalog.checkpoints[name]
        # An incomplete one is kept whole, and what it may still need.
        protected |= s.needs if s.entry.complete else {i.key for i in s.keys}
        if not s.entry.complete:
            protected |= in_flight_needs(catalog, s)
    delete: set[str] = set()
    rows: list[PlanRow] = []
    for s in sorted(catalog.checkpoints.values(), key=lambda s: (s.entry.time, s.entry.name)):
        name = s.entry.name
        if name in kept:
            rows.append(PlanRow(name=name, action="keep", reason=kept[name], keys=0, bytes=0))
            continue
        doomed = [
            i
            for i in s.keys
            if i.key not in protected and not (is_temp(i.key) and now - i.modified < grace_s)
        ]
        reason = gone[name]
        if len(doomed) < len(s.keys):
            reason += f"; {len(s.keys) - len(doomed)} keys stay (needed, or a young temp)"
        delete.update(i.key for i in doomed)
        rows.append(
            PlanRow(
                name=name,
                action="delete",
                reason=reason,
                keys=len(doomed),
                bytes=sum(i.size for i in doomed),
            )
        )
    temps = [
        i
        for i in _temp_candidates(catalog)
        if i.key not in delete and i.key not in protected and now - i.modified >= grace_s
    ]
    if temps:
        rows.append(
            PlanRow(
                name="(temp)",
                action="collect",
                reason=f"temp objects untouched for {grace_s:g}s (left by crashes)",
                keys=len(temps),
                bytes=sum(i.size for i in temps),
            )
        )
        delete.update(i.key for i in temps)
    return GcPlan(
        location=catalog.url,
        keep=keep,
        grace_s=grace_s,
        dry_run=False,
        rows=rows,
        delete=sorted(delete),
        bytes=sum(r.bytes for r in rows),
    )


def in_flight_needs(catalog: Catalog, s: Scanned) -> set[str]:
    """The keys of other checkpoints an incomplete checkpoint `s` needs or may
    need once complete: what each participant manifest it holds references,
    and for each participant writing into it without a manifest yet, that
    participant's files in the newest complete checkpoint holding it (its
    incremental base: the references are not known until the manifest is)."""
    out: set[str] = set()
    for keys in s.parts.values():
        out |= keys
    writing = {p for p in (participant_of(i.key) for i in s.keys) if p is not None}
    done = catalog.complete()
    for part in sorted(writing - s.parts.keys()):
        base = next((c for c in done if part in c.parts), None)
        if base is not None:
            out |= base.parts[part]
    return out


def _temp_candidates(catalog: Catalog) -> list[BlobInfo]:
    found = [i for s in catalog.checkpoints.values() for i in s.keys if is_temp(i.key)]
    # At the root itself only our own (a LATEST replace, a location probe).
    found += [i for i in catalog.root_keys if "/" not in i.key and is_temp(i.key)]
    return found


def apply_plan(blobs: Blobs, plan: GcPlan) -> GcPlan:
    """Delete what the plan says, in one batched call."""
    if plan.delete:
        blobs.delete(plan.delete)
        _prune_local_dirs(blobs, plan)
    return msgspec.structs.replace(plan, deleted=True)


def _prune_local_dirs(blobs: Blobs, plan: GcPlan) -> None:
    """On disk a deleted checkpoint would leave its empty folders behind (an
    object store has no folders); remove those that are empty, nothing else."""
    from ray_ckpt.storage.blobstore.local_blobs import LocalBlobs

    if not isinstance(blobs, LocalBlobs):
        return
    for name in plan.deleted_checkpoints:
        top = blobs.root / name
        for dirpath, _dirs, _files in sorted(
            os.walk(top / GYM), key=lambda w: len(w[0]), reverse=True
        ):
            with contextlib.suppress(OSError):  # not empty: something stays in it
                os.rmdir(dirpath)
        with contextlib.suppress(OSError):
            os.rmdir(top)


def collect(
    blobs: Blobs,
    keep: int,
    *,
    dry_run: bool = False,
    grace_s: float = DEFAULT_GRACE_S,
    now: float | None = None,
) -> GcPlan:
    """Scan the root, plan, and (unless `dry_run`) delete: `ray-ckpt gc`."""
    plan = plan_retention(
        scan(blobs), keep, now=time.time() if now is None else now, grace_s=grace_s
    )
    if dry_run:
        return msgspec.structs.replace(plan, dry_run=True)
    return apply_plan(blobs, plan)


__all__ = [
    "DEFAULT_GRACE_S",
    "GcPlan",
    "PlanRow",
    "Scanned",
    "apply_plan",
    "collect",
    "plan_retention",
]
