"""Checkpoints: crash-safe format, resume selection, the Checkpointer, preemption, export and transfer."""
