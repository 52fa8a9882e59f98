"""Checkpoint storage: records files, participant manifests, the Gym manifest.

Four rooms, each importing only the rooms before it:

- `blobstore` -- bytes and where they live: everything goes through a `Blobs`
  that `open_location` makes from a location: an absolute path or `file://`
  URI (`LocalBlobs`), or `s3://` / `gs://` (`ObjectBlobs`, via obstore);
  `check_location` probes one up front;
- `records` -- the `Record` unit and the records file format;
- `participant` -- one participant's files: its records, their attachments
  (content-addressed blobs) and manifest, which may reference unchanged
  records and blobs in its previous checkpoint's files (`incremental`:
  `Previous`, `ChainPolicy`);
- `root` -- the checkpoint root: the Gym manifest, `LATEST`, the catalog,
  retention.

`seam` (the store the participant engine writes through) stands above
them all.  The public API is re-exported here.
"""

from ray_ckpt.storage.blobstore.blobs import BlobInfo, BlobMissing, Blobs, is_temp
from ray_ckpt.storage.blobstore.durable import WriteStop
from ray_ckpt.storage.blobstore.local_blobs import LocalBlobs
from ray_ckpt.storage.blobstore.locations import check_location, open_location
from ray_ckpt.storage.participant.incremental import ChainPolicy, Previous
from ray_ckpt.storage.participant.participant_store import (
    ParticipantManifest,
    load_manifest,
    participant_dir,
    read_participant,
    write_participant,
)
from ray_ckpt.storage.records.records_format import FORMAT
from ray_ckpt.storage.root.gym_manifest import (
    CheckpointReport,
    GymEntry,
    GymManifest,
    ParticipantCheck,
    read_gym_manifest,
    verify_checkpoint,
    write_gym_manifest,
)

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
