"""The local on-disk format: a checkpoint folder's layout, manifest and hashes, reading and verifying it,
writing it atomically (now or on a background thread), the room it needs, the folder's lock, and the
checkpoints set aside as non-finite. Other packages reach these through :mod:`ddpkit.checkpoint`."""
