"""Sharded checkpoints: every rank writes its own shards of a sharded (FSDP) model and optimizer through
torch.distributed.checkpoint, and rank 0 completes the folder in the local format. Other packages reach
these through :mod:`ddpkit.checkpoint`."""
