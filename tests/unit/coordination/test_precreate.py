"""Participant folders made up front: created durably with one fsync per parent
folder, nothing on an object store, and a failure only logged."""

from __future__ import annotations

import logging
import pathlib

import pytest

from coordination.engine.roots import precreate_participant_dirs
from ray_ckpt.storage.blobstore import durable


def test_folders_are_made_with_one_fsync_per_parent(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[pathlib.Path] = []
    real = durable.fsync_dir
    monkeypatch.setattr(durable, "fsync_dir", lambda p: (synced.append(p), real(p)))
    ck = tmp_path / "ck"
    members = [("environment", "e1"), ("environment", "e2"), ("model", "m1")]
    precreate_participant_dirs(str(ck), members)
    for kind, inst in members:
        assert (ck / "gym" / kind / inst).is_dir()
    # tmp_path (gained ck), ck (gym), gym (two kinds), each kind folder once.
    assert sorted(synced) == sorted(
        [tmp_path, ck, ck / "gym", ck / "gym" / "environment", ck / "gym" / "model"]
    )
    assert len(synced) == len(set(synced))
    synced.clear()
    precreate_participant_dirs(str(ck), members)  # all there: nothing to sync
    assert synced == []


def test_an_object_store_has_no_folders_to_make(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    made: list[list[pathlib.Path]] = []
    monkeypatch.setattr(durable, "ensure_dirs", lambda paths: made.append(list(paths)))
    with caplog.at_level(logging.WARNING):
        precreate_participant_dirs("s3://bucket/run/ck", [("environment", "e1")])
    # Neither a folder made (under some local path taken from the URL) nor a
    # failure swallowed: the object store is recognised and left alone.
    assert made == []
    assert caplog.records == []
    precreate_participant_dirs("/abs/ck", [("environment", "e1")])  # the same seam, on disk
    assert made == [[pathlib.Path("/abs/ck/gym/environment/e1")]]


def test_a_failure_is_logged_not_raised(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING):
        precreate_participant_dirs(str(blocker / "ck"), [("environment", "e1")])
        precreate_participant_dirs(str(tmp_path / "ck"), [("environment", "../escape")])
    assert len([r for r in caplog.records if "participant folders" in r.message]) == 2
    assert not (tmp_path / "escape").exists()
