"""The Gym-manifest hooks: written last at commit, read first at restore.

These are the coordinator's only touch points with `ray_ckpt.storage`; the
driver and the core take them as injectable callables so unit tests can run
without writing checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ManifestWriter = Callable[[str, str, list[dict[str, Any]]], Any]
LatestWriter = Callable[[str, str], None]
# checkpoint dir → None once a new checkpoint may commit there (raises if not)
DirectoryGuard = Callable[[str], None]
# checkpoint dir → (source checkpoint ID, {(kind, instance)} listed in its Gym manifest)
ManifestReader = Callable[[str], tuple[str | None, set[tuple[str, str]]]]


def write_gym_manifest_from_replies(
    checkpoint_dir: str, checkpoint_id: str, manifests: list[dict[str, Any]]
) -> Any:
    """The real writer: participant manifests from commit replies → Gym manifest.

    Passed on as the participants sent them: ours or NeMo Gym's shape, each is
    checked against its bytes on disk there (`write_gym_manifest`)."""
    from ray_ckpt.storage import write_gym_manifest

    return write_gym_manifest(checkpoint_dir, checkpoint_id=checkpoint_id, manifests=manifests)


def read_listed(checkpoint_dir: str) -> tuple[str | None, set[tuple[str, str]]]:
    from ray_ckpt.errors import InvalidCheckpointState
    from ray_ckpt.storage import open_location, read_gym_manifest
    from ray_ckpt.storage.blobstore.blobs import blob_name
    from ray_ckpt.storage.root.gym_manifest import GYM_MANIFEST_KEY, has_gym_manifest

    blobs = open_location(checkpoint_dir)
    if not has_gym_manifest(blobs):
        raise InvalidCheckpointState(
            f"missing Gym manifest {blob_name(blobs, GYM_MANIFEST_KEY)}: checkpoint incomplete "
            "or absent (a checkpoint NeMo Gym's controller wrote has none: restore it with "
            "allow_without_gym_manifest=True, `ray-ckpt restore --without-gym-manifest`)"
        )
    gym = read_gym_manifest(blobs)
    return gym.checkpoint_id, {(e.kind, e.instance) for e in gym.participants}


def read_listed_or_participants(checkpoint_dir: str) -> tuple[str | None, set[tuple[str, str]]]:
    """The explicit opt-in reader (`allow_without_gym_manifest`): the Gym
    manifest when there is one, else the participant manifests themselves —
    what NeMo Gym's controller leaves (it writes no Gym manifest), each
    complete and all of one checkpoint ID (`read_participant_manifests`)."""
    from ray_ckpt.storage import open_location
    from ray_ckpt.storage.root.gym_manifest import has_gym_manifest, read_participant_manifests

    blobs = open_location(checkpoint_dir)
    if has_gym_manifest(blobs):
        return read_listed(checkpoint_dir)
    cid, found = read_participant_manifests(blobs)
    return cid, set(found)
