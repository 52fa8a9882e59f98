"""The storage benchmark's incremental figures: a commit with F changed, a chain restore.

Set up once per mix, untimed, in the benchmark's location: a full base
checkpoint `ck-0` and a chain `ck-1 .. ck-K` of incremental ones (K =
`ChainPolicy().full_every - 1`, the deepest chain the default policy makes),
siblings under one root as the incremental API needs.  Each generation
changes the same fraction F of the episodes (the ones still stepping: the
others finished their rollouts and stay as they were), each with a new
`Record.version`, so the unchanged ones are referenced without being encoded.

Timed in each repetition, interleaved with the full commit and restore:

* `inc_commit_s`: an incremental commit over `ck-0` with F changed, and the
  bytes it wrote (`inc_mb`: its records object plus its manifest, compared
  with the full commit's records plus manifest in `full_mb`);
* `chain_restore_s`: a restore of `ck-K`, reading across K + 1 files;
* `raw_chain_read_s`: the bytes that restore reads, fetched bare (no hash,
  no decode), so `raw_chain_over_raw_read` (over `raw_read_s`, the full
  file read whole) says what the location's ranged reads cost by themselves.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from storage_data import changed

from ray_ckpt.storage import (
    Blobs,
    load_manifest,
    open_location,
    read_participant,
    write_participant,
)
from ray_ckpt.storage.participant.incremental import ChainPolicy, Previous
from ray_ckpt.storage.participant.participant_manifest import MANIFEST_NAME, participant_key
from ray_ckpt.storage.participant.referenced import READERS, ReadBuffers, ranged_reads
from ray_ckpt.storage.records.record import Record

KIND, INSTANCE = "bench", "p0"
DEPTH = ChainPolicy().full_every - 1


def written_mb(where: Blobs, manifest: Any) -> float:
    """What one commit wrote: its records object and its manifest."""
    pkey = participant_key(KIND, INSTANCE)
    records = where.info(f"{pkey}/{manifest.records_file}").size
    return (records + where.info(f"{pkey}/{MANIFEST_NAME}").size) / 1e6


class Chain:
    """A base and a chain of depth `DEPTH` under `root`; incremental commits over the base."""

    def __init__(self, root: str, records: list[Record], fraction: float) -> None:
        self.root = root
        self.next_gen = changed(records, fraction, 1)
        prev = self._commit("ck-0", records, None)
        self.base = Previous(location=f"{root}/ck-0", manifest=prev)
        for gen in range(1, DEPTH + 1):
            location = f"{root}/ck-{gen - 1}"
            prev = self._commit(f"ck-{gen}", changed(records, fraction, gen), (location, prev))
        if prev.chain_depth != DEPTH:
            raise RuntimeError(f"the chain reached depth {prev.chain_depth}, not {DEPTH}")
        self.tip = f"{root}/ck-{DEPTH}"

    def _commit(self, name: str, records: list[Record], previous: Any) -> Any:
        return write_participant(
            open_location(f"{self.root}/{name}"),
            kind=KIND,
            instance=INSTANCE,
            checkpoint_id=name,
            records=records,
            previous=None if previous is None else Previous(*previous),
        )

    def incremental(self, name: str) -> float:
        """One incremental commit over the base (timed by the caller); MB written."""
        where = open_location(f"{self.root}/{name}")
        m = write_participant(
            where,
            kind=KIND,
            instance=INSTANCE,
            checkpoint_id=name,
            records=self.next_gen,
            previous=self.base,
        )
        if m.chain_depth != 1:
            raise RuntimeError(
                f"the incremental commit was written in full (depth {m.chain_depth})"
            )
        return written_mb(where, m)

    def restore_tip(self) -> int:
        _, restored = read_participant(
            open_location(self.tip), kind=KIND, instance=INSTANCE, checkpoint_id=None
        )
        return len(restored)

    def raw_tip_read(self) -> int:
        """The bytes a restore of the tip reads, fetched bare: its own records
        object whole, and every referenced range as the restore coalesces
        them, on as many threads, beside it; nothing hashed or decoded.  Over
        `raw_read_s` (the full file read whole) it says what the location's
        ranged reads cost, apart from our code."""
        where = open_location(self.tip)
        manifest = load_manifest(where, kind=KIND, instance=INSTANCE, checkpoint_id=None)
        root, reads = ranged_reads(where, manifest)
        own = f"{participant_key(KIND, INSTANCE)}/{manifest.records_file}"
        buffers = ReadBuffers()  # reused, as the restore reuses its own

        def bare(key: str, start: int, length: int) -> int:
            buf, data = buffers.read(root, key, start, length)
            buffers.give(buf)
            return len(data)

        with ThreadPoolExecutor(READERS + 1) as pool:
            ranges = [pool.submit(bare, *read) for read in reads]
            got = sum(len(c) for c in where.stream(own))
            return got + sum(f.result() for f in ranges)
