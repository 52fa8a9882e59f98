"""The coordinator's memory in Ray's GCS key-value store, reachable from every node.

The journal (`KvJournal`, by default: a coordinator Ray restarts on another
node finds it there), the periodic loop's settings and the registrations all
keep one key each here.  Ray's KV store has no public Python API;
`ray.experimental.internal_kv` is the one Ray's own libraries use.  Callers
write off the event loop (each call is a blocking GCS round trip).  The
engine's journal protocol and its file and memory stores are
`coordination.engine.journal`, which knows nothing of Ray.
"""

from __future__ import annotations

from coordination.engine.journal import (
    Journal,
    JournalEntry,
    JournalStore,
    decode,
    encode,
)

KV_NAMESPACE = "ray-ckpt"  # the GCS KV namespace every journal key lives in
GCS = "gcs"  # `state_dir` naming the GCS KV store explicitly


def kv_put(key: bytes, data: bytes) -> None:
    """One value in Ray's GCS KV store (the journal, the periodic loop's and
    the registrations' keys all go through these three)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, data, overwrite=True, namespace=KV_NAMESPACE)


def kv_get(key: bytes) -> bytes | None:
    from ray.experimental import internal_kv

    data: bytes | None = internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
    return data


def kv_del(key: bytes) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)


def open_journal(state_dir: str | None, *, namespace: str, name: str) -> JournalStore:
    """The coordinator's journal: GCS KV unless a directory is named."""
    if state_dir is None or state_dir == GCS:
        return KvJournal(kv_key(namespace, name))
    return Journal(state_dir)


def kv_key(namespace: str, name: str) -> bytes:
    return f"journal/{namespace}/{name}".encode()


class KvJournal:
    """One key in Ray's GCS key-value store (reachable from every node)."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def record(self, entry: JournalEntry) -> None:
        self.write(encode(entry))

    def write(self, data: bytes) -> None:
        kv_put(self.key, data)

    def load(self) -> JournalEntry | None:
        return decode(kv_get(self.key))

    def clear(self) -> None:
        kv_del(self.key)
