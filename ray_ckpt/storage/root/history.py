"""What happened to each checkpoint, saved with it: its timeline and its restores.

Beside the Gym manifest, ``gym/_timeline.json`` holds the checkpoint's
timeline — every participant's phases and the coordinator's steps as span
records (`ray_ckpt.tracing.SpanRecord`, the same records the coordinator's
OpenTelemetry spans and metrics come from), its trigger, durability, bytes,
and how far each episode of its scope had got (`Progress`).  Each restore
from it adds ``gym/_restores/<restore-id>.json``: its own timeline and its
restart bias (`RestartBias`: how many episodes continued, restarted or were
lost, by how far they had got).  Both are created, never replaced, like
every other file of a checkpoint, and a restore never touches the
checkpoint's own files; the leading underscore keeps the names out of the
participant namespace (`manifest_shapes.present_participants`).

They are written after the Gym manifest, so a checkpoint is complete
without them (an older checkpoint, one NeMo Gym's controller wrote, or one
whose coordinator died between the two has none): readers say so, never
fail.  Everything goes through `Blobs`, so `ray-ckpt timeline DIR` and
`ray-ckpt report ROOT` read a local directory and a bucket alike, from any
machine, whether the coordinator that wrote them still runs or not.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from ray_ckpt.errors import CheckpointError, InvalidCheckpointState
from ray_ckpt.identity import EpisodeId
from ray_ckpt.storage.blobstore.blobs import BlobMissing, Blobs, blob_name
from ray_ckpt.storage.blobstore.locations import join_location, open_location
from ray_ckpt.storage.participant.participant_manifest import GYM, Where, blobs_of
from ray_ckpt.storage.root.catalog import scan
from ray_ckpt.tracing import SpanRecord

log = logging.getLogger(__name__)

HISTORY_SCHEMA = 1
TIMELINE_KEY = f"{GYM}/_timeline.json"
RESTORES_PREFIX = f"{GYM}/_restores/"

# How far an episode had got, by steps done: where a restart costs little
# (0), a few steps, or most of a long episode.  "unknown": no participant
# said (a restart-only episode, or a participant that records no progress).
BUCKETS = ("0", "1-2", "3-5", "6-10", "11+", "unknown")
OUTCOMES = ("continued", "restarted", "lost")


class Progress(msgspec.Struct, frozen=True, omit_defaults=True):
    """How far one episode had got when checkpointed, where a participant said."""

    steps: int | None = None  # steps done (the steps framework's record)
    tokens: int | None = None  # tokens generated (a model's cut), where known

    def merged(self, other: Progress) -> Progress:
        """Two participants' views of one episode: the furthest of each."""
        return Progress(
            steps=_most(self.steps, other.steps), tokens=_most(self.tokens, other.tokens)
        )


def _most(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def bucket_of(progress: Progress | None) -> str:
    steps = None if progress is None else progress.steps
    if steps is None:
        return "unknown"
    if steps <= 0:
        return "0"
    if steps <= 2:
        return "1-2"
    if steps <= 5:
        return "3-5"
    if steps <= 10:
        return "6-10"
    return "11+"


class BiasRow(msgspec.Struct, frozen=True, kw_only=True):
    bucket: str
    continued: int = 0
    restarted: int = 0
    lost: int = 0


class RestartBias(msgspec.Struct, frozen=True, kw_only=True):
    """A restore's episodes by outcome and by how far each had got.

    `continued`: restored, it goes on from its checkpointed state;
    `restarted`: asked for, but no participant held state for it, so it
    starts over; `lost`: the checkpoint held it (in its scope) but the
    restore did not ask for it, so its progress is dropped.  `rows` lists
    every bucket of `BUCKETS`, in that order; `tokens` sums the tokens
    generated per outcome, over the episodes whose participants said."""

    rows: list[BiasRow]
    tokens: dict[str, int] = msgspec.field(default_factory=dict)
    # False when the source checkpoint has no saved timeline: progress and
    # `lost` are then unknown (every episode is under "unknown", lost 0).
    known: bool = True

    def totals(self) -> dict[str, int]:
        return {o: sum(getattr(r, o) for r in self.rows) for o in OUTCOMES}

    def as_table(self) -> dict[str, dict[str, int]]:
        """{bucket: {continued, restarted, lost}}: the demo's `--json` shape."""
        return {
            r.bucket: {"continued": r.continued, "restarted": r.restarted, "lost": r.lost}
            for r in self.rows
        }


def restart_bias(
    requested: Sequence[EpisodeId],
    continued: Iterable[str],
    checkpointed: Iterable[str] | None,
    progress: Mapping[str, Progress],
) -> RestartBias:
    """The bias of one restore.  `requested`: the episodes asked for;
    `continued`: the capture keys (as requested) some participant installed;
    `checkpointed`: the capture keys of the source checkpoint's scope (None:
    unknown, no saved timeline); `progress`: by checkpointed capture key.
    Episodes are matched by rollout, so a request for another attempt of a
    checkpointed rollout is that rollout, not a loss."""
    counts = {b: dict.fromkeys(OUTCOMES, 0) for b in BUCKETS}
    tokens = dict.fromkeys(OUTCOMES, 0)
    by_rollout = {_rollout(k): p for k, p in progress.items()}
    done = set(continued)

    def add(outcome: str, p: Progress | None) -> None:
        counts[bucket_of(p)][outcome] += 1
        if p is not None and p.tokens is not None:
            tokens[outcome] += p.tokens

    asked = set()
    for e in requested:
        asked.add(e.rollout_id)
        p = progress.get(e.capture_key) or by_rollout.get(e.rollout_id)
        add("continued" if e.capture_key in done else "restarted", p)
    lost = set()
    for key in checkpointed or ():
        rollout = _rollout(key)
        if rollout not in asked and rollout not in lost:
            lost.add(rollout)
            add("lost", progress.get(key))
    return RestartBias(
        rows=[BiasRow(bucket=b, **counts[b]) for b in BUCKETS],
        tokens={o: n for o, n in tokens.items() if n},
        known=checkpointed is not None,
    )


def _rollout(capture_key: str) -> str:
    try:
        return EpisodeId.from_capture_key(capture_key).rollout_id
    except CheckpointError:
        return capture_key  # not an episode's key: only ever equal to itself


class Timeline(msgspec.Struct, kw_only=True):
    """One checkpoint's or restore's timeline, as kept in memory and as saved."""

    checkpoint_id: str  # the operation's ID (a restore's: `restore-...`)
    op: str  # checkpoint | restore
    trigger: str = "manual"
    outcome: str = "open"  # open | ok | failed | aborted (called off before a commit)
    schema_version: int = HISTORY_SCHEMA
    durability: str = "sync"
    checkpoint_dir: str | None = None
    started_at: float | None = None  # epoch seconds
    finished_at: float | None = None
    # participant → bytes of its records (None: not known, an async one not yet durable)
    bytes: dict[str, int] = msgspec.field(default_factory=dict)
    total_bytes: int | None = None
    # The scope by capture key: continued (some participant exported state)
    # or restart (none did), and how far each had got (`Progress`).
    continued: list[str] = msgspec.field(default_factory=list)
    restart: list[str] = msgspec.field(default_factory=list)
    progress: dict[str, Progress] = msgspec.field(default_factory=dict)
    # A restore's: the checkpoint it restored and its restart bias.
    source_checkpoint_id: str | None = None
    restart_bias: RestartBias | None = None
    spans: list[SpanRecord] = msgspec.field(default_factory=list)


class CheckpointHistory(msgspec.Struct, frozen=True, kw_only=True):
    """A checkpoint directory's saved timeline (None if it has none) and its restores."""

    location: str
    timeline: Timeline | None
    restores: list[Timeline]
    problems: list[str] = msgspec.field(default_factory=list)  # unreadable files, named


def encode(tl: Timeline) -> bytes:
    return msgspec.json.format(msgspec.json.encode(tl), indent=1) + b"\n"


def restore_key(restore_id: str) -> str:
    if not restore_id or "/" in restore_id or restore_id.startswith("."):
        raise InvalidCheckpointState(f"bad restore ID {restore_id!r}")
    return f"{RESTORES_PREFIX}{restore_id}.json"


def save_timeline(checkpoint_dir: Where, tl: Timeline) -> bool:
    """Create ``gym/_timeline.json``; False if one is there already (kept as it is)."""
    return blobs_of(checkpoint_dir).create(TIMELINE_KEY, encode(tl)) is None


def save_restore(checkpoint_dir: Where, tl: Timeline) -> bool:
    """Create ``gym/_restores/<restore-id>.json`` in the checkpoint restored from."""
    return blobs_of(checkpoint_dir).create(restore_key(tl.checkpoint_id), encode(tl)) is None


def _decode(blobs: Blobs, key: str) -> Timeline:
    try:
        return msgspec.json.decode(blobs.read(key), type=Timeline)
    except msgspec.DecodeError as exc:
        where = blob_name(blobs, key)
        raise InvalidCheckpointState(f"unreadable timeline {where}: {exc}") from None


def read_timeline(checkpoint_dir: Where) -> Timeline | None:
    """The checkpoint's saved timeline; None if it has none."""
    blobs = blobs_of(checkpoint_dir)
    try:
        return _decode(blobs, TIMELINE_KEY)
    except BlobMissing:
        return None


def read_history(checkpoint_dir: Where) -> CheckpointHistory:
    """The saved timeline and every restore's, oldest restore first; an
    unreadable one is named in `problems` and skipped, never raised."""
    blobs = blobs_of(checkpoint_dir)
    problems: list[str] = []
    try:
        timeline = read_timeline(blobs)
    except InvalidCheckpointState as exc:
        timeline, problems = None, [exc.detail]
    restores = []
    for info in blobs.list(RESTORES_PREFIX.rstrip("/")):
        if not info.key.startswith(RESTORES_PREFIX) or not info.key.endswith(".json"):
            continue
        try:
            restores.append(_decode(blobs, info.key))
        except (InvalidCheckpointState, BlobMissing) as exc:
            problems.append(exc.detail)
    restores.sort(key=lambda t: (t.started_at or 0.0, t.checkpoint_id))
    return CheckpointHistory(
        location=blobs.url, timeline=timeline, restores=restores, problems=problems
    )


def progress_from(replies: Mapping[str, object]) -> dict[str, Progress]:
    """Merge the `progress` the participants' commit replies carry, by capture
    key (`{key: {"steps": n, "tokens": m}}`); anything malformed is skipped."""
    merged: dict[str, Progress] = {}
    for reply in replies.values():
        listed = reply.get("progress") if isinstance(reply, Mapping) else None
        if not isinstance(listed, Mapping):
            continue
        for key, p in listed.items():
            if not isinstance(key, str) or not isinstance(p, Mapping):
                continue
            one = Progress(steps=_count(p.get("steps")), tokens=_count(p.get("tokens")))
            merged[key] = merged[key].merged(one) if key in merged else one
    return merged


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


class HistoryRow(msgspec.Struct, frozen=True, kw_only=True):
    """One checkpoint of a root, with what was saved of its history."""

    name: str
    checkpoint_id: str | None
    time: float
    complete: bool
    bytes: int  # every object under <name>/gym/
    participants: int
    episodes: int
    # The incremental chain: the earlier checkpoints whose records this one
    # references (it needs them to restore), and the later ones that need it.
    builds_on: list[str]
    referenced_by: list[str]
    latest: bool
    history: CheckpointHistory


class RootHistory(msgspec.Struct, frozen=True, kw_only=True):
    location: str
    rows: list[HistoryRow]  # oldest first


def read_root_history(root: Where) -> RootHistory:
    """Every checkpoint under `root`, oldest first, each with its saved
    timeline and restores (one listing, then small reads; no records)."""
    blobs = blobs_of(root)
    catalog = scan(blobs)
    latest = catalog.latest.name if catalog.latest is not None else None
    rows = []
    for entry in catalog.entries:
        scanned = catalog.checkpoints[entry.name]
        builds_on = sorted({k.partition("/")[0] for k in scanned.needs} - {entry.name})
        rows.append(
            HistoryRow(
                name=entry.name,
                checkpoint_id=entry.checkpoint_id,
                time=entry.time,
                complete=entry.complete,
                bytes=entry.bytes,
                participants=entry.participants,
                episodes=entry.episodes,
                builds_on=builds_on,
                referenced_by=entry.referenced_by,
                latest=entry.name == latest,
                history=read_history(_child(blobs, entry.name)),
            )
        )
    return RootHistory(location=blobs.url, rows=rows)


def _child(blobs: Blobs, name: str) -> Blobs:
    return open_location(join_location(blobs.url, name))
