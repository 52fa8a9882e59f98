"""Checkpoint storage: records files, participant manifests, the Gym manifest.

Everything goes through a `Blobs` (`blobs.py`) that `open_location` makes from
a location: an absolute path or `file://` URI (`LocalBlobs`), or `s3://` /
`gs://` (`ObjectBlobs`, via obstore).  `check_location` probes one up front.
A participant's checkpoint may reference unchanged records in its previous
one's files (`incremental`: `Previous`, `ChainPolicy`).
"""

from ray_ckpt.storage.blobs import BlobInfo, BlobMissing, Blobs, is_temp
from ray_ckpt.storage.durable import WriteStop
from ray_ckpt.storage.gym_manifest import (
    CheckpointReport,
    GymEntry,
    GymManifest,
    ParticipantCheck,
    read_gym_manifest,
    verify_checkpoint,
    write_gym_manifest,
)
from ray_ckpt.storage.incremental import ChainPolicy, Previous
from ray_ckpt.storage.local_blobs import LocalBlobs
from ray_ckpt.storage.locations import check_location, open_location
from ray_ckpt.storage.participant_store import (
    ParticipantManifest,
    load_manifest,
    participant_dir,
    read_participant,
    write_participant,
)
from ray_ckpt.storage.records_format import FORMAT

__all__ = [
    "FORMAT",
    "BlobInfo",
    "BlobMissing",
    "Blobs",
    "ChainPolicy",
    "CheckpointReport",
    "GymEntry",
    "GymManifest",
    "LocalBlobs",
    "ParticipantCheck",
    "ParticipantManifest",
    "Previous",
    "WriteStop",
    "check_location",
    "is_temp",
    "load_manifest",
    "open_location",
    "participant_dir",
    "read_gym_manifest",
    "read_participant",
    "verify_checkpoint",
    "write_gym_manifest",
    "write_participant",
]
