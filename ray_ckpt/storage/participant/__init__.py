"""One participant's files under a checkpoint: its manifest (`participant_manifest`,
either shape: `manifest_shapes`), writing and reading its records
(`participant_store`), its records' attachments as content-addressed blobs
(`attachments`), and incremental checkpoints that reference an earlier
one's frames and blobs (`incremental`, `referenced`).  Imports only `records` and
`blobstore` below it.
"""
