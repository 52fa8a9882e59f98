"""The handle's API as the README promises it: every call has an async twin
(`a` + its name), and every phase call takes a deadline."""

from __future__ import annotations

import inspect

from coordination import CoordinatorHandle, aconnect, connect

# Installing signal handlers is synchronous by nature (the handlers then
# schedule work on the running loop).
NO_TWIN = {"checkpoint_on_signal", "stop_checkpoint_on_signal"}
PHASE_CALLS = ("prepare", "commit", "resume", "restore", "retire", "retire_many", "forget")


def public_methods() -> dict[str, object]:
    return {
        name: fn
        for name, fn in inspect.getmembers(CoordinatorHandle, inspect.isfunction)
        if not name.startswith("_")
    }


def test_every_call_has_an_async_twin() -> None:
    methods = public_methods()
    sync = {n for n, fn in methods.items() if not inspect.iscoroutinefunction(fn)}
    assert sorted(n for n in sync - NO_TWIN if f"a{n}" not in methods) == []
    for name in sync - NO_TWIN:
        assert inspect.iscoroutinefunction(methods[f"a{name}"]), name
    assert inspect.iscoroutinefunction(aconnect)
    assert not inspect.iscoroutinefunction(connect)


def test_every_phase_call_takes_a_deadline() -> None:
    methods = public_methods()
    for name in PHASE_CALLS:
        for variant in (name, f"a{name}"):
            params = inspect.signature(methods[variant]).parameters  # type: ignore[arg-type]
            assert "deadline_s" in params, variant


def test_each_pair_of_twins_is_one_operation() -> None:
    """Made from one definition: the same parameters, reply and docstring
    (an async twin written apart drifts: a parameter or a doc added to one)."""
    methods = public_methods()
    pairs = [n for n in methods if f"a{n}" in methods and n not in NO_TWIN]
    assert "checkpoint" in pairs
    assert "status" in pairs
    for name in pairs:
        sync, twin = methods[name], methods[f"a{name}"]
        assert inspect.signature(sync) == inspect.signature(twin), name  # type: ignore[arg-type]
        assert sync.__doc__ == twin.__doc__, name
        assert sync.__wrapped__ is twin.__wrapped__, name  # type: ignore[attr-defined]
