"""The asynchronous commit's capture: a true copy of each exported state, cheap.

The capture runs while admission is closed, so its cost is the pause.  It
copies the containers (dict and list, key order kept) and shares the leaves:
every leaf `check_json` admits (None, bool, int, float, str, bytes) is
immutable, so once the containers are copied no later change of the live
state can reach what is written.  The store then encodes, hashes and writes
the copy in the background, pipelined like the synchronous commit.

The check is `check_json`'s (its level-by-level walk, which here also adds up
the containers' sizes); the copy is `msgspec.to_builtins`, in C, which given
only dicts, lists and those leaves rebuilds every dict and list and returns
the leaves themselves (bytes kept as bytes).

Cost, by measurement (this machine, 2 shared cores; one host's share of the
pause benchmark, 250 text-mix states; medians of 7, ms):

    state    before: check + encode to bytes   copy in Python   now: check + to_builtins
    350 KB              70                          46-61                 40
    35 KB                8.6                         5-7                   7.3

The encode's cost grows with the bytes, the copy's with the containers, so
the gain is largest for states of long strings (tool outputs, messages).

`captured_bytes` is the copy's own memory: its containers (`sys.getsizeof` of
the live ones, which it copies), 36 MB for the benchmark's 1,000 x 350 KB
text states (the encoded capture held 360 MB).  The leaves stay alive while
the copy does: one the live state replaces during the write is held by the
copy until the write ends, so at worst the copy holds one state's worth.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ray_ckpt.storage.record import Record, check_json, plain_size


class NotPlain(Exception):
    """The state holds something `check_json` refuses."""


def copy_state(value: Any) -> tuple[Any, int]:
    """(a copy of `value` no change of `value` can reach, the copy's own bytes).

    Raises `NotPlain` for anything `check_json` would refuse."""
    size = plain_size(value)
    if size is None:
        raise NotPlain
    # Only dicts, lists and immutable leaves are left: msgspec rebuilds every
    # dict and list (keys in order) and hands back the leaves themselves.
    return msgspec.to_builtins(value, builtin_types=(bytes,)), size


def capture(record: Record) -> tuple[Record, int]:
    """`record` with a true copy of its state, and the copy's size; a state
    `check_json` refuses raises `InvalidCheckpointState` naming the path."""
    try:
        state, size = copy_state(record.state)
    except NotPlain:
        check_json(record.state, episode=record.key)
        raise AssertionError("check_json admitted what plain_size refused") from None
    return Record(record.key, state, record.version), size
