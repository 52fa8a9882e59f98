"""Bytes and where they live: the `Blobs` seam and its stores, and locations.

The lowest room of `ray_ckpt.storage`: it knows keys and bytes, never records
or manifests.  `blobs` is the seam, `local_blobs` (POSIX, with `direct_io`,
`writeback` and the `durable` steps) and `object_blobs` (s3://, gs://) its
stores; `locations` parses, probes and names a checkpoint location, and
`location_errors` turns a directory that cannot be used into a typed error.
"""
