"""Checkpoints in object storage (S3, GCS, Azure...): the same folders, manifests and guarantees as on disk.

A Checkpointer given a URL (``Checkpointer("s3://bucket/prefix/run", ...)``) writes each checkpoint exactly
as it does on disk, into a local staging folder (:mod:`~ddpkit.checkpoint.remote.staging`: ``checkpoint.cache=``,
else ``$DDPKIT_CACHE/checkpoints/...``, else ``~/.cache/ddpkit/checkpoints/...``), then uploads it on a
background thread while training goes on (:mod:`~ddpkit.checkpoint.remote.writer`):

- every file first, the manifest with the SHA-256s last: a checkpoint exists in the bucket only once its
  manifest object does (:func:`~ddpkit.checkpoint.remote.transfer.upload_checkpoint`);
- at most one upload in flight: the next save waits for it, and so do a preemption and ``close()``;
- a failed upload is retried with backoff, then ``on_write_error`` decides as for a disk: stop (exit status
  74) or warn and go on;
- ``keep`` and the best checkpoint are applied in the bucket too, deleting a checkpoint's manifest first
  so that a half-deleted one is never taken as complete, and never the newest complete one.

``resume="auto"`` lists the prefix, downloads the newest checkpoint with a manifest into the staging folder,
verifying every file's size and SHA-256 (:func:`~ddpkit.checkpoint.remote.transfer.fetch_checkpoint`); one
that does not verify is skipped, in one line, for the one before it.

Two runs never write one prefix unnoticed (:mod:`~ddpkit.checkpoint.remote.lease`): the first creates a
lease object with a conditional create (S3's ``If-None-Match``), renews it while it lives and deletes it at
the end; the second is refused in one line naming the holder.

The file systems are fsspec's (s3fs for ``s3://``: ``pip install 'ddpkit[s3]'``; gcsfs, adlfs... where
installed); credentials come only from that library's own sources (environment, profile, instance role),
and ddpkit never writes them anywhere.
"""
