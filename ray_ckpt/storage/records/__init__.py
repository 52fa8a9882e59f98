"""The records format: `Record`, its length-framed MessagePack files, and
streaming them through hashing threads (`record`, `records_format`,
`records_io`, `pipeline`).  Imports only `blobstore` below it.
"""
