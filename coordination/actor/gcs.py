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

from coordination.engine.epoch import CoordinatorEpoch
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


class GcsEpochs:
    """Coordinator epochs (`coordination.engine.epoch`) in the GCS KV store,
    one sequence per coordinator name, shared by all its incarnations.

    Atomic without a compare-and-swap: epoch `n` is the key
    `epoch/<namespace>/<name>/<n>` created with `overwrite=False`, which the
    GCS does for exactly one caller (the others are told it exists and try
    `n + 1`).  So two incarnations starting at once never hold the same
    epoch, and the newest is the highest key listed.  One small key per
    start or restart; they are kept (a key removed could be taken again by
    an incarnation that read an older newest)."""

    # A start that loses this many races in a row gives up (never in practice).
    MAX_TRIES = 1000

    def __init__(self, namespace: str, name: str) -> None:
        self.prefix = f"epoch/{namespace}/{name}/".encode()

    def newest(self) -> int:
        """The highest epoch taken (0: none yet); a blocking GCS call."""
        from ray.experimental import internal_kv

        keys = internal_kv._internal_kv_list(self.prefix, namespace=KV_NAMESPACE)
        taken = [int(k[len(self.prefix) :]) for k in keys if k[len(self.prefix) :].isdigit()]
        return max(taken, default=0)

    def take(self) -> int:
        """A new epoch, greater than every one taken before; a blocking GCS call."""
        from ray.experimental import internal_kv

        n = self.newest() + 1
        for _ in range(self.MAX_TRIES):
            existed = internal_kv._internal_kv_put(
                self.prefix + str(n).encode(), b"", overwrite=False, namespace=KV_NAMESPACE
            )
            if not existed:
                return n
            n += 1
        raise RuntimeError(f"no coordinator epoch taken after {self.MAX_TRIES} tries")

    def epoch(self) -> CoordinatorEpoch:
        """A new incarnation's epoch, taken now (blocking)."""
        return CoordinatorEpoch(self.take(), self.newest)


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
