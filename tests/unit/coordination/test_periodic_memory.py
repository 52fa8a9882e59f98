"""The periodic loop's settings in the journal's directory (the GCS KV store
variant runs in tests/ray/test_periodic.py)."""

from __future__ import annotations

import pathlib

from coordination.actor.periodic_control import MEMORY_NAME, PeriodicConfig, PeriodicMemory


def test_saved_settings_load_back_and_clear(tmp_path: pathlib.Path) -> None:
    memory = PeriodicMemory(str(tmp_path / "state"), namespace="n", name="c")
    assert memory.load() is None
    config = PeriodicConfig("/ckpt", 30.0, 3, "run-")
    memory.save(config)
    assert PeriodicMemory(str(tmp_path / "state"), namespace="n", name="c").load() == config
    memory.save(PeriodicConfig("/other", 5.0, None, ""))
    assert memory.load() == PeriodicConfig("/other", 5.0, None, "")
    assert [p.name for p in (tmp_path / "state").iterdir()] == [MEMORY_NAME]
    memory.clear()
    assert memory.load() is None
    memory.clear()  # idempotent


def test_unreadable_settings_are_ignored(tmp_path: pathlib.Path) -> None:
    (tmp_path / MEMORY_NAME).write_bytes(b"{torn")
    assert PeriodicMemory(str(tmp_path), namespace="n", name="c").load() is None
