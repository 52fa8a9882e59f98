"""The storage seam the controller writes and reads records through.

`FileRecordStore` is the real one (durable, manifest-last files under
`<dir>/gym/<kind>/<instance>/`, see `ray_ckpt.storage`); unit tests of the
pure controller logic may pass an in-memory store instead.  Both are
synchronous: the controller runs them in a thread under the call's deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ray_ckpt.records import Record


class StopHandle(Protocol):
    def stop(self) -> None: ...


class RecordStore(Protocol):
    def new_stop(self) -> StopHandle: ...

    def write(
        self,
        checkpoint_dir: str,
        *,
        kind: str,
        instance: str,
        checkpoint_id: str,
        records: Sequence[Record],
        stop: StopHandle,
    ) -> Any:
        """Durably write the records, then the manifest; return the manifest."""
        ...

    def read(
        self,
        checkpoint_dir: str,
        *,
        kind: str,
        instance: str,
        select: Callable[[str], bool],
    ) -> tuple[Any, list[Record]]:
        """Verify and read one participant's records; return (manifest, in-scope records)."""
        ...


class FileRecordStore:
    """Records on disk through `ray_ckpt.storage` (imported lazily: it is heavy)."""

    def new_stop(self) -> StopHandle:
        from ray_ckpt.storage import WriteStop

        return WriteStop()

    def write(
        self,
        checkpoint_dir: str,
        *,
        kind: str,
        instance: str,
        checkpoint_id: str,
        records: Sequence[Record],
        stop: StopHandle,
    ) -> Any:
        from ray_ckpt.storage import WriteStop, write_participant

        assert isinstance(stop, WriteStop)
        return write_participant(
            checkpoint_dir,
            kind=kind,
            instance=instance,
            checkpoint_id=checkpoint_id,
            records=records,
            stop=stop,
        )

    def read(
        self,
        checkpoint_dir: str,
        *,
        kind: str,
        instance: str,
        select: Callable[[str], bool],
    ) -> tuple[Any, list[Record]]:
        from ray_ckpt.storage import read_participant

        return read_participant(
            checkpoint_dir, kind=kind, instance=instance, checkpoint_id=None, select=select
        )
