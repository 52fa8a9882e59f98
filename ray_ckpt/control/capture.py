"""The asynchronous commit's capture: a true copy of each exported state, cheap.

The capture runs while admission is closed, so its cost is the pause; what
can wait for the resume, waits.

Under the pause (`capture`): `msgspec.to_builtins`, in C, rebuilds every
dict and list (key order kept) and hands back the immutable leaves (None,
bool, int, float, str, bytes) themselves, so no later change of the live
state can reach the copy.  It converts what is not plain (a set to a list, an
Enum member to its value, a dataclass to a dict, a datetime to a string) and
refuses the rest (the hook); `copy == state`, again in C, then shows whether
it converted anything that would come back different: a set, a plain Enum
member, a datetime, a dataclass, a Struct, a bytearray never compare equal
to what they became.  Any doubt, and the state goes to `check_json` at once,
whose typed error names the path.

After the resume (`Audited`, on the writer's thread, each record as the
store reads it to encode): the copy, private to the write, is walked as
`check_json` walks a state: a tuple (kept a tuple by the copy), a key that
is not a string, nesting deeper than the limit fail the write with
`check_json`'s typed error (the pending checkpoint fails, nothing is
published, the records object is discarded); the same walk adds up the
copy's size.

What the two together let through and the synchronous commit refuses: a
value equal to its plain form, that is a member of an int- or str-valued
Enum (written as its value) and a subclass of dict or list (written as a
dict or list).  Each restores equal to what was exported; only its type is
gone.  Telling them apart needs the per-object walk this split moves out of
the pause.

Cost, by measurement (this machine, 2 shared cores; one host's share of the
pause benchmark, 250 text-mix states; medians of 7, ms):

    state     check + copy under the pause   copy + compare   audit, after
    350 KB             42 (29 + 12)                 9-11             23-29
    35 KB             6.5                           1.0               5.5

`captured_bytes` is the copy's own memory: its containers (`sys.getsizeof`),
36 MB for the benchmark's 1,000 x 350 KB text states (an encoded capture
held 360 MB), measured by the audit.  The leaves stay alive while the copy
does: one the live state replaces during the write is held by the copy
until the write ends, so at worst the copy holds one state's worth.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NoReturn, overload

import msgspec

from ray_ckpt.storage.records.record import Record, check_json, plain_size


class NotPlain(Exception):
    """The state holds something the fast copy does not vouch for."""


def _refuse(value: Any) -> NoReturn:
    raise NotPlain


def copy_state(value: Any) -> Any:
    """A copy of `value` no change of `value` can reach, equal to it.

    Raises `NotPlain` when the copy had to change something (or could not
    be made): the caller then asks `check_json`."""
    try:
        copy = msgspec.to_builtins(value, builtin_types=(bytes,), enc_hook=_refuse)
        same = copy == value
    except Exception:  # the hook's refusal, msgspec's, a comparison that raised
        raise NotPlain from None
    if not same:
        raise NotPlain
    return copy


def capture(record: Record) -> Record:
    """`record` with a true copy of its state (its version and attachments
    kept); a state `check_json` refuses raises `InvalidCheckpointState`
    naming the path."""
    try:
        state = copy_state(record.state)
    except NotPlain:
        # Only a state `check_json` admits gets here (a NaN at the top level
        # is not equal to itself): the copy of it is exact.
        check_json(record.state, episode=record.key)
        state = msgspec.to_builtins(record.state, builtin_types=(bytes,))
    # The attachments map is copied too (a flat str -> str dict, cheap): the
    # files it names are the exporter's to keep unchanged until the write
    # ends, but the live map may be rebuilt meanwhile.
    attachments = dict(record.attachments) if record.attachments is not None else None
    return Record(record.key, state, record.version, attachments)


def audit_one(record: Record) -> int:
    """One captured copy's own bytes; raises `check_json`'s typed error if it
    is not plain.  Reads only the copy (thread-safe)."""
    size = plain_size(record.state)
    if size is None:
        check_json(record.state, episode=record.key)
        raise AssertionError("check_json admitted what plain_size refused")
    return size


class Audited(Sequence[Record]):
    """The captured records, each audited (`audit_one`) as the write first
    reads it, not all of them before it starts: the disk then begins with the
    first record instead of waiting for a walk of every copy (measured in the
    pause benchmark: that walk, 27 ms per host's share of 1,000 x 350 KB,
    held the background write's first byte back on four busy hosts).  A copy
    that is not plain fails the write where it is read; nothing is published
    (the records object is discarded).  `size` is the copies' bytes once every
    record was read, None until then.  Read by one thread at a time (the
    write's); a retried write audits only what the failed one did not."""

    def __init__(self, records: list[Record]) -> None:
        self._records = records
        self._done = 0
        self._total = 0
        self.size: int | None = None if records else 0

    def __len__(self) -> int:
        return len(self._records)

    @overload
    def __getitem__(self, index: int) -> Record: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Record]: ...

    def __getitem__(self, index: int | slice) -> Record | Sequence[Record]:
        # Not a way around the audit: the stores only iterate.
        return self._records[index]

    def __iter__(self) -> Iterator[Record]:
        for i, record in enumerate(self._records):
            if i == self._done:
                self._total += audit_one(record)
                self._done += 1
                if self._done == len(self._records):
                    self.size = self._total
            yield record


def audit(records: Sequence[Record]) -> int:
    """The captured copies' own bytes, all at once (`audit_one` each)."""
    return sum(audit_one(r) for r in records)
